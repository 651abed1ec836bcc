//! Topic identities: the broker-assigned topic ID and the partition count of named topics.
//!
//! The safe `rdkafka` wrapper has no DescribeTopics call, so this module drives librdkafka's
//! admin API directly through `rdkafka-sys` (`rd_kafka_DescribeTopics`, available since
//! librdkafka 2.3; the bundled build is 2.12). This is the only module of the workspace
//! allowed to use `unsafe`; every block carries its own safety argument.
//!
//! Ownership rules relied on (librdkafka's `rdkafka.h`):
//! - `rd_kafka_TopicCollection_of_topic_names` copies the names; the collection is ours to
//!   destroy, and may be destroyed once `rd_kafka_DescribeTopics` has returned.
//! - `rd_kafka_AdminOptions_new` / `rd_kafka_queue_new` results are ours to destroy.
//! - An event returned by `rd_kafka_queue_poll` is ours to destroy; everything reached from it
//!   (result, topic descriptions, names, UUIDs, partition arrays, errors) is owned by the event
//!   and valid only until the event is destroyed, so all of it is copied into Rust values first.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use rdkafka::admin::AdminClient;
use rdkafka::client::{Client, ClientContext, DefaultClientContext};
use rdkafka_sys as sys;
use rdkafka_sys::types::RDKafkaErrorCode;

/// What the broker says about one topic.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TopicDescription {
    /// The topic's name, as asked for.
    pub name: String,
    /// The topic ID (a UUID): the 8 most significant bytes big-endian, then the 8 least
    /// significant bytes big-endian (the UUID's usual byte order). Never all zero.
    pub id: [u8; 16],
    /// Number of partitions.
    pub partitions: u32,
}

impl TopicDescription {
    /// The topic ID in the canonical `8-4-4-4-12` hex form.
    pub fn id_string(&self) -> String {
        uuid_string(&self.id)
    }
}

/// Formats a 16-byte UUID as `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn uuid_string(id: &[u8; 16]) -> String {
    let mut s = String::with_capacity(36);
    for (i, b) in id.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Resolves topic ID and partition count of each named topic, in the order given.
///
/// Creates a short-lived admin client for `cluster` and runs the blocking call on tokio's
/// blocking pool. An unknown topic, an authorization failure, or no answer within `timeout`
/// is an error naming the topic.
pub async fn describe_topics(
    cluster: impl Into<crate::kafka::Cluster>,
    names: &[String],
    timeout: Duration,
) -> anyhow::Result<Vec<TopicDescription>> {
    let config = crate::kafka::admin_config(cluster);
    let names = names.to_vec();
    tokio::task::spawn_blocking(move || {
        let admin: AdminClient<DefaultClientContext> = config.create().context("creating a Kafka admin client")?;
        describe_topics_blocking(admin.inner(), &names, timeout)
    })
    .await
    .context("the topic describe task panicked")?
}

/// Blocking form of [`describe_topics`] over an existing client (any client type: admin,
/// producer or consumer). Blocks the calling thread for up to `timeout`.
pub fn describe_topics_blocking<C: ClientContext>(
    client: &Client<C>,
    names: &[String],
    timeout: Duration,
) -> anyhow::Result<Vec<TopicDescription>> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let c_names = names
        .iter()
        .map(|n| CString::new(n.as_bytes()).map_err(|_| anyhow!("topic name {n:?} contains NUL")))
        .collect::<anyhow::Result<Vec<CString>>>()?;
    let mut name_ptrs: Vec<*const c_char> = c_names.iter().map(|c| c.as_ptr()).collect();
    let timeout_ms = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX);
    let rk = client.native_ptr();

    // SAFETY: `name_ptrs` holds `name_ptrs.len()` pointers to NUL-terminated strings owned by
    // `c_names`, which outlives this call; librdkafka copies them into the new collection.
    let collection = Owned::new(
        unsafe { sys::rd_kafka_TopicCollection_of_topic_names(name_ptrs.as_mut_ptr(), name_ptrs.len()) },
        sys::rd_kafka_TopicCollection_destroy,
    )
    .context("librdkafka returned no topic collection")?;

    // SAFETY: `rk` is the live handle of `client`, borrowed for the whole function.
    let options = Owned::new(
        unsafe { sys::rd_kafka_AdminOptions_new(rk, sys::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS) },
        sys::rd_kafka_AdminOptions_destroy,
    )
    .context("librdkafka returned no admin options")?;

    let mut errstr = [0 as c_char; 512];
    // SAFETY: `options.0` is a live options object; `errstr` is a writable buffer of the
    // length passed, which librdkafka NUL-terminates.
    let err = unsafe {
        sys::rd_kafka_AdminOptions_set_request_timeout(options.0, timeout_ms, errstr.as_mut_ptr(), errstr.len())
    };
    if err != sys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
        // SAFETY: librdkafka wrote a NUL-terminated message into `errstr`.
        let msg = unsafe { CStr::from_ptr(errstr.as_ptr()) }.to_string_lossy();
        bail!("setting the DescribeTopics request timeout: {msg}");
    }

    // SAFETY: `rk` is live (see above); the queue is destroyed before `client` can be dropped.
    let queue = Owned::new(unsafe { sys::rd_kafka_queue_new(rk) }, sys::rd_kafka_queue_destroy)
        .context("librdkafka returned no queue")?;

    // SAFETY: all four arguments are live objects created above; librdkafka does not keep
    // `collection` or `options` past the call, and posts exactly one result event to `queue`.
    unsafe { sys::rd_kafka_DescribeTopics(rk, collection.0, options.0, queue.0) };

    // Leave the broker a moment past its own request timeout to answer with an error.
    let poll_ms = timeout_ms.saturating_add(1000);
    // SAFETY: `queue.0` is live; the returned event (if any) is ours to destroy.
    let event = Owned::new(unsafe { sys::rd_kafka_queue_poll(queue.0, poll_ms) }, sys::rd_kafka_event_destroy)
        .ok_or_else(|| {
            anyhow!("no DescribeTopics answer within {timeout:?} for topics {names:?} (is the broker up?)")
        })?;

    // SAFETY: `event.0` is a live event.
    let event_err = unsafe { sys::rd_kafka_event_error(event.0) };
    if event_err != sys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
        // SAFETY: `event.0` is live; the string is owned by the event and copied at once.
        let msg = unsafe { opt_cstr(sys::rd_kafka_event_error_string(event.0)) };
        bail!(
            "DescribeTopics for {names:?} failed: {} ({})",
            msg.unwrap_or_default(),
            RDKafkaErrorCode::from(event_err)
        );
    }

    // SAFETY: `event.0` is live; NULL means the event is not a DescribeTopics result.
    let result = unsafe { sys::rd_kafka_event_DescribeTopics_result(event.0) };
    if result.is_null() {
        bail!("librdkafka answered DescribeTopics with an event of another type");
    }
    let mut count = 0usize;
    // SAFETY: `result` is owned by the live event; librdkafka writes the array length to
    // `count` and returns an array of that many description pointers (or NULL when empty).
    let descs = unsafe { sys::rd_kafka_DescribeTopics_result_topics(result, &mut count) };
    let descs: &[*const sys::rd_kafka_TopicDescription_t] = if descs.is_null() || count == 0 {
        &[]
    } else {
        // SAFETY: non-NULL array of `count` elements, alive as long as `event`, which outlives
        // this slice (both end at function exit; the slice is not returned).
        unsafe { std::slice::from_raw_parts(descs, count) }
    };

    let mut found = Vec::with_capacity(descs.len());
    for &desc in descs {
        // SAFETY: `desc` is one element of the live result array (owned by `event`).
        found.push(unsafe { read_description(desc) }?);
    }

    names
        .iter()
        .map(|name| {
            let got = found
                .iter()
                .find(|d| &d.name == name)
                .ok_or_else(|| anyhow!("the broker did not describe topic {name:?}"))?;
            match &got.outcome {
                Ok(d) => Ok(d.clone()),
                Err(e) => Err(anyhow!("topic {name:?}: {e}")),
            }
        })
        .collect()
}

/// One description copied out of librdkafka memory.
struct Found {
    name: String,
    outcome: Result<TopicDescription, String>,
}

/// Raw facts of one topic description, copied out of librdkafka memory.
struct RawDescription {
    name: Option<String>,
    error: Option<(sys::rd_kafka_resp_err_t, String)>,
    id: Option<(i64, i64)>,
    partitions: usize,
}

/// Copies one topic description into Rust values.
///
/// # Safety
/// `desc` must be NULL or point to a live `rd_kafka_TopicDescription_t` (owned by a live
/// result event).
unsafe fn read_description(desc: *const sys::rd_kafka_TopicDescription_t) -> anyhow::Result<Found> {
    if desc.is_null() {
        bail!("librdkafka returned a NULL topic description");
    }
    // SAFETY: `desc` is live per the caller's contract. Each accessor returns NULL or memory
    // owned by `desc` (name, error, UUID, partition array), read or copied here before
    // returning; nothing is freed or kept.
    let raw = unsafe {
        let name = opt_cstr(sys::rd_kafka_TopicDescription_name(desc));
        let error = sys::rd_kafka_TopicDescription_error(desc);
        let error = if error.is_null() {
            None
        } else {
            let code = sys::rd_kafka_error_code(error);
            let msg = opt_cstr(sys::rd_kafka_error_string(error)).unwrap_or_default();
            Some((code, msg))
        };
        let uuid = sys::rd_kafka_TopicDescription_topic_id(desc);
        let id = if uuid.is_null() {
            None
        } else {
            Some((sys::rd_kafka_Uuid_most_significant_bits(uuid), sys::rd_kafka_Uuid_least_significant_bits(uuid)))
        };
        let mut partitions = 0usize;
        let _ = sys::rd_kafka_TopicDescription_partitions(desc, &mut partitions);
        RawDescription { name, error, id, partitions }
    };
    interpret(raw)
}

/// Turns the raw facts of one description into a description or a per-topic error.
fn interpret(raw: RawDescription) -> anyhow::Result<Found> {
    let name = raw.name.ok_or_else(|| anyhow!("librdkafka returned a topic description without a name"))?;
    if let Some((code, msg)) = raw.error {
        if code != sys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            let code = RDKafkaErrorCode::from(code);
            let text = if code == RDKafkaErrorCode::UnknownTopicOrPartition {
                format!("no such topic on the broker ({code}: {msg})")
            } else {
                format!("{code}: {msg}")
            };
            return Ok(Found { name, outcome: Err(text) });
        }
    }
    let outcome = match raw.id {
        None => Err("the broker reported no topic ID".to_string()),
        Some((msb, lsb)) => {
            let mut id = [0u8; 16];
            id[..8].copy_from_slice(&msb.to_be_bytes());
            id[8..].copy_from_slice(&lsb.to_be_bytes());
            if id == [0u8; 16] {
                Err("the broker reported a zero topic ID".to_string())
            } else if raw.partitions == 0 {
                Err("the broker reported no partitions".to_string())
            } else {
                u32::try_from(raw.partitions)
                    .map_err(|_| format!("partition count {} out of range", raw.partitions))
                    .map(|partitions| TopicDescription { name: name.clone(), id, partitions })
            }
        }
    };
    Ok(Found { name, outcome })
}

/// Copies a C string owned by librdkafka.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid during the call.
unsafe fn opt_cstr(p: *const c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        // SAFETY: non-NULL and NUL-terminated per the contract above.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}

/// A librdkafka object (field 0) destroyed by its destructor (field 1) when the guard goes
/// out of scope, so that every early return releases what was created before it.
struct Owned<T>(*mut T, unsafe extern "C" fn(*mut T));

impl<T> Owned<T> {
    /// `None` for a NULL pointer (nothing to destroy).
    fn new(ptr: *mut T, destroy: unsafe extern "C" fn(*mut T)) -> Option<Self> {
        (!ptr.is_null()).then_some(Owned(ptr, destroy))
    }
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: `self.0` is non-NULL, was returned by the librdkafka constructor matching
        // `self.1`, and is destroyed exactly once, here.
        unsafe { (self.1)(self.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::uuid_string;

    #[test]
    fn uuid_is_formatted_in_canonical_hex() {
        let id = [0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x0f, 0xed, 0xcb, 0xa9, 0x87, 0x65, 0x43, 0x21];
        assert_eq!(uuid_string(&id), "12345678-9abc-def0-0fed-cba987654321");
    }
}
