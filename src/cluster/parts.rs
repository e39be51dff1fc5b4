//! Messages cut to fit NATS: a record, a resync, must fit in one NATS
//! message (`max_payload`, 1 MB by default), so longer lists go as parts.

/// Room kept in a message for everything but the list (the record's other
/// fields, the headers).
const HEADROOM: usize = 4096;

/// The most bytes of list items one message should carry.
pub(crate) fn limit(max_payload: usize) -> usize {
    max_payload.saturating_sub(HEADROOM).max(1024)
}

/// `items` in order, cut into parts of at most `limit` bytes by `size`
/// (an item over the limit on its own makes a part of its own). Never
/// empty: no items give one empty part.
pub(crate) fn in_parts<T>(
    items: impl IntoIterator<Item = T>,
    size: impl Fn(&T) -> usize,
    limit: usize,
) -> Vec<Vec<T>> {
    let mut parts: Vec<Vec<T>> = vec![Vec::new()];
    let mut used = 0;
    for item in items {
        let bytes = size(&item);
        if used + bytes > limit && parts.last().is_some_and(|p| !p.is_empty()) {
            parts.push(Vec::new());
            used = 0;
        }
        used += bytes;
        if let Some(part) = parts.last_mut() {
            part.push(item);
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_keep_order_and_stay_under_the_limit() {
        let parts = in_parts(1..=10u32, |_| 30, 100);
        assert_eq!(
            parts,
            vec![vec![1, 2, 3], vec![4, 5, 6], vec![7, 8, 9], vec![10]]
        );
        assert_eq!(
            in_parts(Vec::<u32>::new(), |_| 1, 10),
            vec![Vec::<u32>::new()]
        );
        assert_eq!(
            in_parts([500u32, 1], |x| *x as usize, 100),
            vec![vec![500], vec![1]]
        );
    }
}
