//! A growable bitset over record ids: the oracle's representation of causal histories,
//! so unions and "which of these causes is missing" are word-at-a-time.

/// A set of record ids (dense `u32`s assigned in creation order).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RecordSet {
    words: Vec<u64>,
}

impl RecordSet {
    pub fn new() -> Self {
        RecordSet { words: Vec::new() }
    }

    pub fn insert(&mut self, id: u32) {
        let (w, b) = (id as usize / 64, id % 64);
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1 << b;
    }

    pub fn remove(&mut self, id: u32) {
        let (w, b) = (id as usize / 64, id % 64);
        if let Some(word) = self.words.get_mut(w) {
            *word &= !(1 << b);
        }
    }

    pub fn contains(&self, id: u32) -> bool {
        let (w, b) = (id as usize / 64, id % 64);
        self.words.get(w).is_some_and(|word| word & (1 << b) != 0)
    }

    pub fn union_with(&mut self, other: &RecordSet) {
        if self.words.len() < other.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
    }

    /// `self` without the members of `other`.
    pub fn minus(&self, other: &RecordSet) -> RecordSet {
        let words = self.words.iter().enumerate().map(|(i, w)| w & !other.words.get(i).copied().unwrap_or(0)).collect();
        RecordSet { words }
    }

    /// Members of `self` that are in `within` and not in `have`, in id order.
    pub fn missing(&self, within: &RecordSet, have: &RecordSet) -> Vec<u32> {
        let mut out = Vec::new();
        for (i, &w) in self.words.iter().enumerate() {
            let mut m = w & within.words.get(i).copied().unwrap_or(0) & !have.words.get(i).copied().unwrap_or(0);
            while m != 0 {
                let b = m.trailing_zeros();
                out.push(i as u32 * 64 + b);
                m &= m - 1;
            }
        }
        out
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            let mut m = w;
            std::iter::from_fn(move || {
                if m == 0 {
                    return None;
                }
                let b = m.trailing_zeros();
                m &= m - 1;
                Some(i as u32 * 64 + b)
            })
        })
    }

    pub fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }
}

impl std::fmt::Debug for RecordSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl FromIterator<u32> for RecordSet {
    fn from_iter<T: IntoIterator<Item = u32>>(iter: T) -> Self {
        let mut s = RecordSet::new();
        for id in iter {
            s.insert(id);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_operations() {
        let a: RecordSet = [1, 64, 130, 5].into_iter().collect();
        let within: RecordSet = [1, 5, 64, 200].into_iter().collect();
        let have: RecordSet = [5].into_iter().collect();
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![1, 5, 64, 130]);
        assert_eq!(a.missing(&within, &have), vec![1, 64]);
        assert_eq!(a.minus(&within).iter().collect::<Vec<_>>(), vec![130]);
        let mut b = have.clone();
        b.union_with(&a);
        assert_eq!(b.len(), 4);
        assert!(b.contains(130) && !b.contains(131));
        b.remove(130);
        assert!(!b.contains(130));
        assert!(RecordSet::new().is_empty() && !b.is_empty());
    }
}
