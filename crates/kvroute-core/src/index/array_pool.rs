//! Recycled block arrays for the index's segments.
//!
//! Why this exists: segments come and go by the thousand per second (a
//! store starts one, an eviction frees one, a split or a shift moves
//! positions from one to another), and each holds an array of blocks.
//! Taking those arrays from the allocator cost more than the index's own
//! work once the heap was busy with the caller's freed events: glibc's
//! malloc sorts every chunk freed since the last call before it answers.
//! The pool keeps freed arrays for the next segment that needs one, last
//! in first out (the memory is likely still in cache), up to a bound.
//!
//! Layout: `classes[c]` holds arrays whose capacity is at least `2^c`
//! (and under `2^(c + 1)`), so any array in class `ceil(log2(n))` has room
//! for `n`. `bytes` is the pooled capacity in bytes, never over `limit`.

/// See the module docs.
#[derive(Debug)]
pub struct ArrayPool<T> {
    classes: Vec<Vec<Vec<T>>>,
    bytes: usize,
    limit: usize,
}

impl<T> ArrayPool<T> {
    /// A pool keeping at most `limit` bytes of arrays.
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            classes: Vec::new(),
            bytes: 0,
            limit,
        }
    }

    /// An empty array with room for at least `n` elements: a pooled one if
    /// the pool has one that big, else a new one of exactly `n`.
    pub(crate) fn take(&mut self, n: usize) -> Vec<T> {
        if n == 0 {
            return Vec::new();
        }
        let class = n.next_power_of_two().trailing_zeros() as usize;
        if let Some(v) = self.classes.get_mut(class).and_then(|c| c.pop()) {
            self.bytes -= v.capacity() * size_of::<T>();
            return v;
        }
        Vec::with_capacity(n)
    }

    /// Keep `v`'s memory for a later [`Self::take`]; it is freed instead if
    /// the pool is full.
    pub(crate) fn give(&mut self, mut v: Vec<T>) {
        let size = v.capacity() * size_of::<T>();
        if v.capacity() == 0 || self.bytes + size > self.limit {
            return;
        }
        v.clear();
        let class = v.capacity().ilog2() as usize;
        if self.classes.len() <= class {
            self.classes.resize_with(class + 1, Vec::new);
        }
        if let Some(c) = self.classes.get_mut(class) {
            c.push(v);
            self.bytes += size;
        }
    }

    /// Bytes of pooled arrays (their capacity) and of the pool's own lists.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
            + self
                .classes
                .iter()
                .map(|c| c.capacity() * size_of::<Vec<T>>())
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_back_what_it_was_given_when_big_enough() {
        let mut pool: ArrayPool<u64> = ArrayPool::new(1 << 20);
        let mut v = Vec::with_capacity(100);
        v.extend(0..100u64);
        pool.give(v);
        assert!(pool.bytes() >= 800);
        // 100 sits in class 64: it serves requests up to 64, not 65
        let small = pool.take(64);
        assert!(small.is_empty() && small.capacity() == 100);
        pool.give(small);
        let big = pool.take(65);
        assert_eq!(
            big.capacity(),
            65,
            "a new array, the pooled one is too small"
        );
        // a small request is not served from a much bigger class
        assert_eq!(pool.take(1).capacity(), 1);
        assert_eq!(pool.take(33).capacity(), 100);
        assert_eq!(pool.take(33).capacity(), 33, "the pool is empty again");
    }

    #[test]
    fn keeps_no_more_than_its_limit() {
        let mut pool: ArrayPool<u64> = ArrayPool::new(1000);
        pool.give(Vec::with_capacity(100)); // 800 bytes: kept
        pool.give(Vec::with_capacity(100)); // would make 1600: freed
        assert_eq!(pool.take(64).capacity(), 100);
        assert_eq!(pool.take(64).capacity(), 64);
        pool.give(Vec::new());
        assert_eq!(pool.take(0).capacity(), 0);
    }
}
