//! A hash table of tree positions in which one cache line answers a probe.
//!
//! Why this exists: every stored or removed block costs one probe of its
//! target's engine-hash table, and on an index larger than the cache each
//! probe misses. A SwissTable (hashbrown) keeps its control bytes apart from
//! its entries, so finding a present key touches two lines. Here seven
//! entries and their tags share one 64-byte line, and [`GroupTable::prefetch`]
//! lets a caller start loading the lines of the keys it will probe next, so
//! that their misses overlap with its work instead of queuing one after
//! another.
//!
//! Layout (invariants, checked by `check` in the tests):
//! * Groups of 7 slots, any number of them. `ctrl` byte `i < 7` is slot
//!   `i`'s tag: 0 when empty, else the top byte of the entry's hash
//!   (raised to 1 if it is 0). Byte 7 is the group's overflow count.
//! * An entry lives in its home group (the hash's low 32 bits scaled to the
//!   number of groups, so the tag and check bits stay independent of it)
//!   or, when that is full, in the first group after it with room,
//!   wrapping around. Each group it
//!   passed on the way counts it in its overflow count, so a probe goes on
//!   past a group only while its count is not 0. Removal counts down along
//!   the same way: no tombstones, so a table never needs rehashing to clean
//!   up. A count that reaches 255 stays there until the next resize (probes
//!   past it remain correct, only longer).
//! * Keys are not stored: the caller's `eq` confirms a candidate (the key
//!   lives in the tree), and `rehash` gives a stored value's hash when the
//!   table grows. The table holds at most [`MAX_PER_GROUP`] (3) entries per
//!   group on average, 43% of its slots: at that load the home line
//!   answers 95% of inserts, so a caller prefetches only that line per key,
//!   and the line fill buffers serve twice as many keys in flight as with
//!   two lines each (at 6 per group, 20% of inserts walked past home and
//!   the second line had to be fetched too; measured in
//!   `docs/INDEX_PERFORMANCE.md`, stop 14).
//! * Values leave [`CHECK_BITS`] clear, and the table keeps 8 more bits of
//!   the hash there. A candidate must match those too before `eq` is
//!   asked, so an insert (whose key is nearly always absent) almost never
//!   has a tag match confirmed through the tree: with the tag alone, about
//!   2% of inserts paid two cache misses for one.

const SLOTS: usize = 7;
/// Most entries per group, on average, before the table grows.
pub const MAX_PER_GROUP: usize = 3;
const OVERFLOW_SHIFT: u32 = 56;
const LOW_BYTES: u64 = 0x0101_0101_0101_0101;
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

#[repr(C, align(64))]
#[derive(Clone, Copy, Default)]
struct Group {
    ctrl: u64,
    vals: [u64; SLOTS],
}

impl Group {
    fn tag(&self, i: usize) -> u8 {
        (self.ctrl >> (8 * i)) as u8
    }

    fn overflow(&self) -> u8 {
        (self.ctrl >> OVERFLOW_SHIFT) as u8
    }

    fn set_tag(&mut self, i: usize, tag: u8) {
        let shift = 8 * i as u32;
        self.ctrl = (self.ctrl & !(0xFF << shift)) | (u64::from(tag) << shift);
    }

    fn add_overflow(&mut self) {
        let n = self.overflow().saturating_add(1);
        self.ctrl = (self.ctrl & !(0xFF << OVERFLOW_SHIFT)) | (u64::from(n) << OVERFLOW_SHIFT);
    }

    fn sub_overflow(&mut self) {
        let n = self.overflow();
        if n != u8::MAX {
            let n = n.saturating_sub(1);
            self.ctrl = (self.ctrl & !(0xFF << OVERFLOW_SHIFT)) | (u64::from(n) << OVERFLOW_SHIFT);
        }
    }

    /// Bit `8 * i + 7` set for each slot `i` whose tag may be `tag` (exact
    /// for the lowest; callers confirm each with `tag(i)`).
    #[inline(always)]
    fn candidates(&self, tag: u8) -> u64 {
        // byte 7 (the overflow count) must never look like a match
        let x = (self.ctrl ^ (LOW_BYTES * u64::from(tag))) | (0xFF << OVERFLOW_SHIFT);
        x.wrapping_sub(LOW_BYTES) & !x & HIGH_BITS
    }

    /// The slot holding a value with `tag` and `check` bits that `eq`
    /// accepts.
    #[inline(always)]
    fn find(&self, tag: u8, check: u64, mut eq: impl FnMut(u64) -> bool) -> Option<usize> {
        let mut m = self.candidates(tag);
        while m != 0 {
            let i = (m.trailing_zeros() / 8) as usize;
            m &= m - 1;
            if self.tag(i) == tag
                && let Some(&v) = self.vals.get(i)
                && v & CHECK_BITS == check
                && eq(v & !CHECK_BITS)
            {
                return Some(i);
            }
        }
        None
    }

    /// The first empty slot.
    #[inline(always)]
    fn free_slot(&self) -> Option<usize> {
        match self.candidates(0) {
            0 => None,
            m => Some((m.trailing_zeros() / 8) as usize),
        }
    }
}

/// How many keys ahead of its probes a caller prefetches (measured on the
/// conversation op log: 4 to 32 all do well, 8 best).
pub const PREFETCH_AHEAD: usize = 8;

/// Ask the CPU to start loading the cache line of `x` (x86_64; elsewhere
/// nothing, as aarch64's prefetch intrinsic is not stable yet).
#[inline(always)]
fn prefetch_line<T>(x: Option<&T>) {
    #[cfg(target_arch = "x86_64")]
    if let Some(x) = x {
        // Justified exception to `unsafe_code = "deny"`: `_mm_prefetch` is
        // only a hint (it never faults, reads nothing into the program and
        // changes no state it can observe), and the pointer comes from a
        // live reference. A plain load instead would hold up every later
        // instruction until the line arrives, which is what the prefetch
        // is there to avoid.
        #[allow(unsafe_code)]
        // SAFETY: see above; the intrinsic has no memory-safety preconditions
        // on this pointer.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                (x as *const T).cast::<i8>(),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

#[inline(always)]
fn tag_of(hash: u64) -> u8 {
    ((hash >> 56) as u8).max(1)
}

/// Bits that every value leaves clear: the table keeps 8 more bits of the
/// key's hash there (see the module docs).
pub const CHECK_BITS: u64 = 0xFF << CHECK_SHIFT;
const CHECK_SHIFT: u32 = 24;

#[inline(always)]
fn check_of(hash: u64) -> u64 {
    ((hash >> 48) & 0xFF) << CHECK_SHIFT
}

/// See the module docs. Values are `u64` tree positions.
#[derive(Clone, Default)]
pub struct GroupTable {
    groups: Vec<Group>,
    len: usize,
}

impl GroupTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Make room for `n` entries in all, so that inserting up to that many
    /// never resizes (a resize reads every key back through `rehash`).
    pub fn reserve(&mut self, n: usize, rehash: impl Fn(u64) -> u64) {
        let groups = n.div_ceil(MAX_PER_GROUP);
        if n > 0 && groups > self.groups.len() {
            self.resize(groups, &rehash);
        }
    }

    /// Drop every entry, keeping the room.
    pub fn clear(&mut self) {
        self.groups.fill(Group::default());
        self.len = 0;
    }

    /// Heap bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.groups.capacity() * size_of::<Group>()
    }

    #[inline(always)]
    fn home(&self, hash: u64) -> usize {
        // a u32 times a group count (far below 2^32) fits in a u64
        (((hash & 0xFFFF_FFFF) * self.groups.len() as u64) >> 32) as usize
    }

    #[inline(always)]
    fn next(&self, g: usize) -> usize {
        if g + 1 < self.groups.len() { g + 1 } else { 0 }
    }

    /// Start loading the line a probe for `hash` reads first (its home
    /// group) without waiting for it. A caller probing many keys asks for
    /// the line of the key [`PREFETCH_AHEAD`] places ahead of the one it
    /// probes, so that the misses overlap with the probes' work.
    #[inline(always)]
    pub(crate) fn prefetch(&self, hash: u64) {
        prefetch_line(self.groups.get(self.home(hash)));
    }

    /// For a loop that probes keys 0, 1, 2, ... in order, called before
    /// probing key `k`: prefetches key `k + PREFETCH_AHEAD` (and, at the
    /// first key, the ones before it). `hash_of(i)` is key `i`'s hash, None
    /// past the end.
    #[inline(always)]
    pub fn prefetch_ahead(&self, k: usize, hash_of: impl Fn(usize) -> Option<u64>) {
        if k == 0 {
            for h in (0..PREFETCH_AHEAD).map_while(&hash_of) {
                self.prefetch(h);
            }
        }
        if let Some(h) = hash_of(k + PREFETCH_AHEAD) {
            self.prefetch(h);
        }
    }

    /// (group, slot) of the entry for `hash` that `eq` accepts.
    #[inline(always)]
    fn locate(&self, hash: u64, mut eq: impl FnMut(u64) -> bool) -> Option<(usize, usize)> {
        let tag = tag_of(hash);
        let check = check_of(hash);
        let mut g = self.home(hash);
        for _ in 0..self.groups.len() {
            let group = self.groups.get(g)?;
            if let Some(i) = group.find(tag, check, &mut eq) {
                return Some((g, i));
            }
            if group.overflow() == 0 {
                return None;
            }
            g = self.next(g);
        }
        None
    }

    /// The value for `hash` that `eq` accepts.
    #[inline(always)]
    pub(crate) fn find(&self, hash: u64, eq: impl FnMut(u64) -> bool) -> Option<u64> {
        let (g, i) = self.locate(hash, eq)?;
        self.groups.get(g)?.vals.get(i).map(|&v| v & !CHECK_BITS)
    }

    /// Replace the value for `hash` that `eq` accepts; false if none.
    pub(crate) fn replace(&mut self, hash: u64, eq: impl FnMut(u64) -> bool, value: u64) -> bool {
        let Some((g, i)) = self.locate(hash, eq) else {
            return false;
        };
        match self.groups.get_mut(g).and_then(|x| x.vals.get_mut(i)) {
            Some(v) => {
                debug_assert_eq!(value & CHECK_BITS, 0);
                *v = value | check_of(hash);
                true
            }
            None => false,
        }
    }

    /// Take out the value for `hash` that `eq` accepts.
    #[inline(always)]
    pub fn remove(&mut self, hash: u64, eq: impl FnMut(u64) -> bool) -> Option<u64> {
        let (g, i) = self.locate(hash, eq)?;
        let group = self.groups.get_mut(g)?;
        let v = group.vals.get(i).copied()? & !CHECK_BITS;
        group.set_tag(i, 0);
        self.len -= 1;
        let mut k = self.home(hash);
        while k != g {
            if let Some(x) = self.groups.get_mut(k) {
                x.sub_overflow();
            }
            k = self.next(k);
        }
        Some(v)
    }

    /// Add `value` for `hash` unless `eq` accepts a present value (then
    /// false, nothing added). `rehash` is a stored value's hash, for growth.
    #[inline(always)]
    pub fn insert_unless(
        &mut self,
        hash: u64,
        value: u64,
        mut eq: impl FnMut(u64) -> bool,
        rehash: impl Fn(u64) -> u64,
    ) -> bool {
        // the usual case, in one look at one line: the home group has no
        // overflow (so a present key would be in it), the key is not
        // there, and the group has a free slot, where `place` would put it
        let tag = tag_of(hash);
        let check = check_of(hash);
        let home = self.home(hash);
        let room = self.len < self.groups.len() * MAX_PER_GROUP;
        if let Some(group) = self.groups.get_mut(home)
            && room
            && group.overflow() == 0
        {
            if group.find(tag, check, &mut eq).is_some() {
                return false;
            }
            if let Some(i) = group.free_slot() {
                group.set_tag(i, tag);
                if let Some(v) = group.vals.get_mut(i) {
                    debug_assert_eq!(value & CHECK_BITS, 0);
                    *v = value | check;
                }
                self.len += 1;
                return true;
            }
        }
        if self.locate(hash, &mut eq).is_some() {
            return false;
        }
        self.insert_new(hash, value, rehash);
        true
    }

    /// Add `value` for `hash`, known to be absent.
    #[inline(always)]
    pub(crate) fn insert_new(&mut self, hash: u64, value: u64, rehash: impl Fn(u64) -> u64) {
        if (self.len + 1) > self.groups.len() * MAX_PER_GROUP {
            self.grow(&rehash);
        }
        self.place(hash, value);
        self.len += 1;
    }

    #[inline(always)]
    fn place(&mut self, hash: u64, value: u64) {
        let tag = tag_of(hash);
        let mut g = self.home(hash);
        for _ in 0..self.groups.len() {
            let next = self.next(g);
            let Some(group) = self.groups.get_mut(g) else {
                return;
            };
            if let Some(i) = group.free_slot() {
                group.set_tag(i, tag);
                if let Some(v) = group.vals.get_mut(i) {
                    debug_assert_eq!(value & CHECK_BITS, 0);
                    *v = value | check_of(hash);
                }
                return;
            }
            group.add_overflow();
            g = next;
        }
    }

    fn grow(&mut self, rehash: &impl Fn(u64) -> u64) {
        self.resize((self.groups.len() * 2).max(1), rehash);
    }

    /// Move every entry into `n` groups (enough for them).
    fn resize(&mut self, n: usize, rehash: &impl Fn(u64) -> u64) {
        let old = std::mem::replace(&mut self.groups, vec![Group::default(); n]);
        for group in &old {
            for i in 0..SLOTS {
                if group.tag(i) != 0
                    && let Some(&v) = group.vals.get(i)
                {
                    let v = v & !CHECK_BITS;
                    self.place(rehash(v), v);
                }
            }
        }
    }

    /// Every value, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.groups.iter().flat_map(|g| {
            (0..SLOTS)
                .filter(|&i| g.tag(i) != 0)
                .filter_map(|i| g.vals.get(i).map(|&v| v & !CHECK_BITS))
        })
    }

    /// Check the layout invariants against the true hashes of the values.
    #[cfg(test)]
    pub(crate) fn check(&self, hash_of: impl Fn(u64) -> u64) -> Result<(), String> {
        let n = self.groups.len();
        let mut passed = vec![0u32; n];
        let mut count = 0;
        for (g, group) in self.groups.iter().enumerate() {
            for i in 0..SLOTS {
                let tag = group.tag(i);
                if tag == 0 {
                    continue;
                }
                count += 1;
                let raw = group.vals.get(i).copied().ok_or("slot")?;
                let v = raw & !CHECK_BITS;
                let h = hash_of(v);
                if tag != tag_of(h) || raw & CHECK_BITS != check_of(h) {
                    return Err(format!(
                        "value {v} has tag {tag} and check bits {:#x}, wants {} and {:#x}",
                        raw & CHECK_BITS,
                        tag_of(h),
                        check_of(h)
                    ));
                }
                let mut k = self.home(h);
                while k != g {
                    if let Some(p) = passed.get_mut(k) {
                        *p += 1;
                    }
                    k = self.next(k);
                }
            }
        }
        if count != self.len {
            return Err(format!("len {} but {count} entries", self.len));
        }
        for (g, group) in self.groups.iter().enumerate() {
            let want = passed.get(g).copied().unwrap_or(0);
            let have = u32::from(group.overflow());
            if have != want && have != 255 {
                return Err(format!("group {g}: overflow {have}, entries passed {want}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
