//! The names of one cluster's subjects, streams, buckets and object store,
//! all prefixed by `--cluster-name` so clusters can share a NATS.

/// Every NATS name one cluster uses.
#[derive(Clone, Debug)]
pub struct Names {
    pub log_stream: String,
    pub log_subject: String,
    pub bookings_stream: String,
    /// `<cluster>.bookings`; each replica publishes under `.<replica>`.
    pub bookings_prefix: String,
    pub workers_bucket: String,
    pub sessions_bucket: String,
    pub control_bucket: String,
    pub snapshots_bucket: String,
}

impl Names {
    /// `cluster` is checked by the flag's parser: letters, digits, `-`, `_`.
    pub(crate) fn new(cluster: &str) -> Self {
        Self {
            log_stream: format!("{cluster}_LOG"),
            log_subject: format!("{cluster}.log"),
            bookings_stream: format!("{cluster}_BOOKINGS"),
            bookings_prefix: format!("{cluster}.bookings"),
            workers_bucket: format!("{cluster}_workers"),
            sessions_bucket: format!("{cluster}_sessions"),
            control_bucket: format!("{cluster}_control"),
            snapshots_bucket: format!("{cluster}_snapshots"),
        }
    }

    /// The subject a replica publishes its booking changes on.
    pub(crate) fn bookings_subject(&self, replica: &str) -> String {
        format!("{}.{}", self.bookings_prefix, token(replica))
    }
}

/// `text` as one subject token or key: other bytes than letters, digits,
/// `-` and `_` become `_`.
pub(crate) fn token(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// A session id as a bucket key: hex, so any id maps to a valid key and
/// two ids never share one.
pub(crate) fn session_key(session_id: &str) -> String {
    session_id.bytes().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_cluster_prefix() {
        let n = Names::new("prod-a");
        assert_eq!(n.log_stream, "prod-a_LOG");
        assert_eq!(n.bookings_subject("host.1:2"), "prod-a.bookings.host_1_2");
    }

    #[test]
    fn session_keys_are_distinct_and_valid() {
        assert_eq!(session_key("a."), "612e");
        assert_ne!(session_key("a."), session_key("a_"));
    }
}
