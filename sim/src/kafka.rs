//! A simulated Kafka: topics named by ID, partitions whose every offset is occupied (by a
//! business record, a transaction marker, or an aborted record), `read_committed` fetches
//! that stop at the last stable offset, log-start retention, and topic deletion and
//! recreation under a new ID.

use std::collections::{BTreeMap, BTreeSet};

use parsley::channel::{ChannelId, Position, TopicId};
use parsley::engine::ChannelFact;

pub type TxnId = u32;

/// What a record carries: the oracle's id for it (standing in for its value bytes), its
/// key, and its `parsley.causes` header values.
#[derive(Clone, Debug)]
pub struct StoredRecord {
    pub id: u32,
    pub key: u16,
    pub headers: Vec<Option<Vec<u8>>>,
    pub txn: Option<TxnId>,
}

/// One offset of a partition.
#[derive(Clone, Debug)]
pub enum Entry {
    Record(StoredRecord),
    /// A transaction's commit or abort marker: occupies an offset, never fetched.
    Marker {
        txn: TxnId,
        commit: bool,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TxnState {
    Open,
    Committed,
    Aborted,
}

#[derive(Clone, Debug, Default)]
pub struct PartitionLog {
    pub log_start: Position,
    /// `entries[o]` is offset `o`; entries below `log_start` stay for the record but are
    /// never fetched.
    pub entries: Vec<Entry>,
    /// Open transactions on this partition and their first offset here.
    open: BTreeMap<TxnId, Position>,
}

impl PartitionLog {
    pub fn log_end(&self) -> Position {
        self.entries.len() as Position
    }

    /// The last stable offset: the first offset of the oldest open transaction, else the
    /// log end. A `read_committed` fetch never returns anything at or above it.
    pub fn last_stable(&self) -> Position {
        self.open.values().copied().min().unwrap_or(self.log_end())
    }
}

#[derive(Clone, Debug)]
pub struct TopicLog {
    pub name: String,
    pub id: TopicId,
    pub deleted: bool,
    pub partitions: Vec<PartitionLog>,
}

/// A record as a `read_committed` fetch returns it.
#[derive(Clone, Debug)]
pub struct Fetched {
    pub position: Position,
    pub id: u32,
    pub key: u16,
    pub headers: Vec<Option<Vec<u8>>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FetchError {
    /// The fetch position is below the log start: those offsets are gone.
    OutOfRange { log_start: Position },
    /// The topic no longer exists.
    TopicGone,
}

#[derive(Debug, Default)]
pub struct SimKafka {
    topics: Vec<TopicLog>,
    by_id: BTreeMap<TopicId, usize>,
    /// The current topic of each name.
    by_name: BTreeMap<String, usize>,
    txns: BTreeMap<TxnId, (TxnState, BTreeSet<ChannelId>)>,
}

impl SimKafka {
    pub fn new() -> Self {
        SimKafka::default()
    }

    pub fn create_topic(&mut self, name: &str, id: TopicId, partitions: u32) {
        assert!(!self.by_id.contains_key(&id), "topic IDs are unique");
        let i = self.topics.len();
        self.topics.push(TopicLog {
            name: name.to_string(),
            id,
            deleted: false,
            partitions: (0..partitions).map(|_| PartitionLog::default()).collect(),
        });
        self.by_id.insert(id, i);
        self.by_name.insert(name.to_string(), i);
    }

    /// Deletes the current topic of `name`; its records stay readable to the oracle only.
    pub fn delete_topic(&mut self, name: &str) -> Option<TopicId> {
        let i = self.by_name.remove(name)?;
        self.topics[i].deleted = true;
        Some(self.topics[i].id)
    }

    pub fn resolve(&self, name: &str) -> Option<TopicId> {
        self.by_name.get(name).map(|&i| self.topics[i].id)
    }

    pub fn topic(&self, id: &TopicId) -> Option<&TopicLog> {
        self.by_id.get(id).map(|&i| &self.topics[i])
    }

    pub fn partition(&self, channel: &ChannelId) -> &PartitionLog {
        let t = self.topic(&channel.topic).expect("a channel of a known topic");
        &t.partitions[channel.partition as usize]
    }

    fn partition_mut(&mut self, channel: &ChannelId) -> &mut PartitionLog {
        let i = self.by_id[&channel.topic];
        &mut self.topics[i].partitions[channel.partition as usize]
    }

    pub fn log_start(&self, channel: &ChannelId) -> Position {
        self.partition(channel).log_start
    }

    /// What a host learns of a channel when it prunes: gone, or live with its log start.
    pub fn fact(&self, channel: &ChannelId) -> ChannelFact {
        match self.topic(&channel.topic) {
            None => ChannelFact::Unknown,
            Some(t) if t.deleted => ChannelFact::TopicGone,
            Some(t) => match t.partitions.get(channel.partition as usize) {
                Some(p) => ChannelFact::Live { log_start: p.log_start },
                None => ChannelFact::TopicGone,
            },
        }
    }

    /// Appends a record outside any transaction; returns the acknowledged offset.
    pub fn produce(&mut self, channel: ChannelId, id: u32, key: u16, headers: Vec<Option<Vec<u8>>>) -> Position {
        let p = self.partition_mut(&channel);
        p.entries.push(Entry::Record(StoredRecord { id, key, headers, txn: None }));
        p.log_end() - 1
    }

    pub fn begin_txn(&mut self) -> TxnId {
        let id = self.txns.len() as TxnId;
        self.txns.insert(id, (TxnState::Open, BTreeSet::new()));
        id
    }

    /// Appends a record inside open transaction `txn`.
    pub fn produce_in(
        &mut self,
        txn: TxnId,
        channel: ChannelId,
        id: u32,
        key: u16,
        headers: Vec<Option<Vec<u8>>>,
    ) -> Position {
        let (state, channels) = self.txns.get_mut(&txn).expect("known transaction");
        assert_eq!(*state, TxnState::Open, "produce into an open transaction");
        channels.insert(channel);
        let p = self.partition_mut(&channel);
        let offset = p.log_end();
        p.open.entry(txn).or_insert(offset);
        p.entries.push(Entry::Record(StoredRecord { id, key, headers, txn: Some(txn) }));
        offset
    }

    /// Commits or aborts `txn`: a marker lands on every partition it wrote.
    pub fn end_txn(&mut self, txn: TxnId, commit: bool) {
        let (state, channels) = self.txns.get_mut(&txn).expect("known transaction");
        assert_eq!(*state, TxnState::Open);
        *state = if commit { TxnState::Committed } else { TxnState::Aborted };
        for channel in channels.clone() {
            let p = self.partition_mut(&channel);
            p.open.remove(&txn);
            p.entries.push(Entry::Marker { txn, commit });
        }
    }

    pub fn txn_state(&self, txn: TxnId) -> TxnState {
        self.txns[&txn].0
    }

    fn visible<'a>(&self, entry: &'a Entry) -> Option<&'a StoredRecord> {
        match entry {
            Entry::Record(r) => match r.txn {
                None => Some(r),
                Some(t) if self.txn_state(t) == TxnState::Committed => Some(r),
                Some(_) => None,
            },
            Entry::Marker { .. } => None,
        }
    }

    /// Whether `position` holds no record a read-committed consumer returns: a transaction
    /// marker, or a record of an aborted or still open transaction.
    pub fn is_control_or_aborted(&self, channel: &ChannelId, position: Position) -> bool {
        let p = self.partition(channel);
        position >= 0 && (position as usize) < p.entries.len() && self.visible(&p.entries[position as usize]).is_none()
    }

    /// A `read_committed` fetch of at most `max` records from offset `from`.
    pub fn fetch(&self, channel: &ChannelId, from: Position, max: usize) -> Result<Vec<Fetched>, FetchError> {
        self.fetch_to(channel, from, max).map(|(records, _)| records)
    }

    /// As [`SimKafka::fetch`], with the consumer's position after it: past the last record
    /// returned, and past every marker and aborted record up to the last stable offset when
    /// the fetch was not cut short by `max` (a read-committed consumer's position moves past
    /// control records it never returns).
    pub fn fetch_to(
        &self,
        channel: &ChannelId,
        from: Position,
        max: usize,
    ) -> Result<(Vec<Fetched>, Position), FetchError> {
        let t = self.topic(&channel.topic).ok_or(FetchError::TopicGone)?;
        if t.deleted {
            return Err(FetchError::TopicGone);
        }
        let p = &t.partitions[channel.partition as usize];
        if from < p.log_start {
            return Err(FetchError::OutOfRange { log_start: p.log_start });
        }
        let mut out = Vec::new();
        let mut o = from;
        while o < p.last_stable() && out.len() < max {
            if let Some(r) = self.visible(&p.entries[o as usize]) {
                out.push(Fetched { position: o, id: r.id, key: r.key, headers: r.headers.clone() });
            }
            o += 1;
        }
        Ok((out, o.max(from)))
    }

    /// True when a fetch from `from` would return at least one record.
    pub fn fetchable(&self, channel: &ChannelId, from: Position) -> bool {
        matches!(self.fetch(channel, from, 1), Ok(v) if !v.is_empty())
    }

    /// True when an aborted record sits at an offset in `from..to`.
    pub fn aborted_between(&self, channel: &ChannelId, from: Position, to: Position) -> bool {
        let p = self.partition(channel);
        (from.max(0)..to.min(p.log_end())).any(|o| match &p.entries[o as usize] {
            Entry::Record(StoredRecord { txn: Some(t), .. }) => self.txn_state(*t) == TxnState::Aborted,
            _ => false,
        })
    }

    /// Moves the log start forward to `to` (retention). Never backwards, never past the end.
    pub fn advance_log_start(&mut self, channel: &ChannelId, to: Position) {
        let p = self.partition_mut(channel);
        assert!(to <= p.log_end(), "log start past the log end");
        if to > p.log_start {
            p.log_start = to;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ch(t: &SimKafka, name: &str, p: u32) -> ChannelId {
        ChannelId::new(t.resolve(name).unwrap(), p)
    }

    #[test]
    fn read_committed_skips_markers_and_aborts_and_stops_at_the_open_transaction() {
        let mut k = SimKafka::new();
        k.create_topic("t", TopicId::from_bytes([1; 16]), 1);
        let c = ch(&k, "t", 0);
        assert_eq!(k.produce(c, 0, 0, vec![]), 0);
        let a = k.begin_txn();
        assert_eq!(k.produce_in(a, c, 1, 0, vec![]), 1);
        k.end_txn(a, false); // marker at 2
        let b = k.begin_txn();
        assert_eq!(k.produce_in(b, c, 2, 0, vec![]), 3);
        assert_eq!(k.produce(c, 3, 0, vec![]), 4);
        let ids = |k: &SimKafka| k.fetch(&c, 0, 10).unwrap().iter().map(|f| (f.position, f.id)).collect::<Vec<_>>();
        assert_eq!(ids(&k), vec![(0, 0)], "the open transaction at 3 blocks the fetch");
        k.end_txn(b, true); // marker at 5
        assert_eq!(ids(&k), vec![(0, 0), (3, 2), (4, 3)]);
        assert!(k.aborted_between(&c, 0, 3) && !k.aborted_between(&c, 2, 5));
        k.advance_log_start(&c, 3);
        assert!(matches!(k.fetch(&c, 0, 10), Err(FetchError::OutOfRange { log_start: 3 })));
        assert_eq!(k.fetch(&c, 3, 10).unwrap().len(), 2);
    }

    #[test]
    fn deletion_and_recreation_make_a_new_channel() {
        let mut k = SimKafka::new();
        k.create_topic("t", TopicId::from_bytes([1; 16]), 1);
        let old = ch(&k, "t", 0);
        k.produce(old, 0, 0, vec![]);
        assert_eq!(k.delete_topic("t"), Some(old.topic));
        k.create_topic("t", TopicId::from_bytes([2; 16]), 1);
        let new = ch(&k, "t", 0);
        assert_ne!(old, new);
        assert_eq!(k.fact(&old), ChannelFact::TopicGone);
        assert_eq!(k.fact(&new), ChannelFact::Live { log_start: 0 });
        assert!(matches!(k.fetch(&old, 0, 1), Err(FetchError::TopicGone)));
        assert!(!k.fetchable(&new, 0));
    }
}
