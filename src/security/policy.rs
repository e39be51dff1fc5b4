//! The auth policy (`--auth-policy FILE`): which identities exist, how each
//! is recognised (client-certificate SANs, a bearer token's SHA-256 digest)
//! and which roles it holds. Read once at start; a mistake in the file stops
//! the start with the entry and key named.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    path::Path,
    sync::Arc,
};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use kvroute_core::types::WorkerId;

/// What an identity may do; each role reaches exactly its methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// kvroute.v1.Router: SelectWorker and the request lifecycle.
    Frontend,
    /// kvroute.v1.Workers, for its listed worker ids only.
    Worker,
    /// Admin reads and ExplainSelection.
    OperatorRead,
    /// Cordon, uncordon, snapshot, and releasing anyone's booking.
    OperatorWrite,
}

impl Role {
    pub(crate) const fn label(self) -> &'static str {
        match self {
            Self::Frontend => "frontend",
            Self::Worker => "worker",
            Self::OperatorRead => "operator-read",
            Self::OperatorWrite => "operator-write",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The worker ids a `worker` identity may act for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerIds {
    Any,
    /// Inclusive ranges.
    Ranges(Vec<(WorkerId, WorkerId)>),
}

impl WorkerIds {
    pub(crate) fn contains(&self, id: WorkerId) -> bool {
        match self {
            Self::Any => true,
            Self::Ranges(ranges) => ranges.iter().any(|&(lo, hi)| (lo..=hi).contains(&id)),
        }
    }

    /// Reads `worker_ids`: `["*"]` alone, or ids and inclusive `lo-hi`
    /// ranges of decimal digits. Whatever else (a sign, a `*` beside ids,
    /// an empty list) is refused rather than read as more than it says.
    fn parse(entries: &[String]) -> Result<Self, String> {
        if entries.iter().any(|e| e.trim() == "*") {
            return if entries.len() == 1 {
                Ok(Self::Any)
            } else {
                Err("worker_ids: `*` must stand alone (it means every id)".into())
            };
        }
        if entries.is_empty() {
            return Err(
                "worker_ids names no worker id (give ids, `lo-hi` ranges, or [\"*\"])".into(),
            );
        }
        let mut ranges = Vec::with_capacity(entries.len());
        for entry in entries {
            let number = |text: &str| {
                let text = text.trim();
                let digits = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
                digits
                    .then(|| text.parse::<WorkerId>().ok())
                    .flatten()
                    .ok_or_else(|| {
                        format!("worker_ids: `{entry}` is not an id, a range `lo-hi` or `*`")
                    })
            };
            let range = match entry.split_once('-') {
                Some((lo, hi)) => (number(lo)?, number(hi)?),
                None => {
                    let id = number(entry)?;
                    (id, id)
                }
            };
            if range.0 > range.1 {
                return Err(format!("worker_ids: `{entry}` runs backwards"));
            }
            ranges.push(range);
        }
        Ok(Self::Ranges(ranges))
    }
}

/// One identity of the policy.
#[derive(Debug, PartialEq, Eq)]
pub struct Identity {
    /// Shared with every booking the identity makes.
    pub name: Arc<str>,
    pub roles: Vec<Role>,
    /// `Some` for identities with the `worker` role.
    pub worker_ids: Option<WorkerIds>,
}

impl Identity {
    pub(crate) fn has(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }

    /// The identity a certificate-authenticated client has when no policy
    /// is loaded: every role, every worker id (etcd's client-cert-auth alone).
    pub(crate) fn trusted_client(name: &str) -> Self {
        Self {
            name: name.into(),
            roles: vec![
                Role::Frontend,
                Role::Worker,
                Role::OperatorRead,
                Role::OperatorWrite,
            ],
            worker_ids: Some(WorkerIds::Any),
        }
    }
}

/// The loaded policy: identities, by SAN and by token digest.
#[derive(Debug, Default)]
pub struct Policy {
    by_san: HashMap<String, Arc<Identity>>,
    by_token: HashMap<[u8; 32], Arc<Identity>>,
    identities: Vec<Arc<Identity>>,
    /// The identities' names, for the one-name-each check: a set, so a
    /// policy of many identities loads in linear time (it was quadratic).
    names: HashSet<Arc<str>>,
    /// The file's `reflection` key, if it has one.
    pub reflection: Option<bool>,
}

/// The file as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    reflection: Option<bool>,
    #[serde(default)]
    identity: Vec<IdentityEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IdentityEntry {
    name: String,
    roles: Vec<Role>,
    #[serde(default)]
    san: Vec<String>,
    token_sha256: Option<String>,
    worker_ids: Option<Vec<String>>,
}

impl Policy {
    /// Reads and checks a policy file.
    pub(crate) fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses a policy from its TOML text.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let file: PolicyFile = toml::from_str(text).map_err(|e| e.message().to_owned())?;
        let mut policy = Self {
            reflection: file.reflection,
            ..Self::default()
        };
        for (n, entry) in file.identity.into_iter().enumerate() {
            let at = format!("identity #{} ({:?})", n + 1, entry.name);
            policy.add(entry).map_err(|e| format!("{at}: {e}"))?;
        }
        if policy.identities.is_empty() {
            return Err("the policy names no [[identity]]".into());
        }
        Ok(policy)
    }

    fn add(&mut self, entry: IdentityEntry) -> Result<(), String> {
        if entry.name.trim().is_empty() || entry.name.chars().any(char::is_control) {
            return Err("name must be non-empty printable text".into());
        }
        if self.names.contains(entry.name.as_str()) {
            return Err("another identity has this name".into());
        }
        if entry.roles.is_empty() {
            return Err("roles is empty".into());
        }
        if entry.san.is_empty() && entry.token_sha256.is_none() {
            return Err("give `san` (client certificate) or `token_sha256` (bearer token)".into());
        }
        let worker_ids = match (entry.roles.contains(&Role::Worker), &entry.worker_ids) {
            (true, Some(ids)) => Some(WorkerIds::parse(ids)?),
            (true, None) => {
                return Err(
                    "role worker needs worker_ids (a list of ids, `lo-hi` ranges, or [\"*\"])"
                        .into(),
                );
            }
            (false, Some(_)) => return Err("worker_ids without the worker role".into()),
            (false, None) => None,
        };
        let token = entry
            .token_sha256
            .as_deref()
            .map(parse_digest)
            .transpose()?;
        let identity = Arc::new(Identity {
            name: entry.name.into(),
            roles: entry.roles,
            worker_ids,
        });
        for san in entry.san {
            if let Some(other) = self.by_san.insert(san.clone(), identity.clone()) {
                return Err(format!("san `{san}` is also {:?}'s", other.name));
            }
        }
        if let Some(digest) = token
            && let Some(other) = self.by_token.insert(digest, identity.clone())
        {
            return Err(format!("the same token digest is also {:?}'s", other.name));
        }
        self.names.insert(identity.name.clone());
        self.identities.push(identity);
        Ok(())
    }

    /// The identity a bearer token belongs to.
    pub(crate) fn by_token(&self, token: &str) -> Option<Arc<Identity>> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_token.get(&digest).cloned()
    }

    /// The identity of the first of a certificate's SANs the policy lists.
    pub(crate) fn by_sans<'a>(
        &self,
        sans: impl IntoIterator<Item = &'a str>,
    ) -> Option<Arc<Identity>> {
        sans.into_iter()
            .find_map(|san| self.by_san.get(san).cloned())
    }

    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn identities(&self) -> &[Arc<Identity>] {
        &self.identities
    }
}

fn parse_digest(hex: &str) -> Result<[u8; 32], String> {
    let hex = hex.trim();
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("token_sha256 must be 64 hex digits (printf %s \"$TOKEN\" | sha256sum)".into());
    }
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
            .map_err(|_| "token_sha256 must be hex".to_string())?;
    }
    Ok(digest)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN_DIGEST: &str = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"; // "foo"

    fn policy(text: &str) -> Result<Policy, String> {
        Policy::parse(text)
    }

    #[test]
    fn identities_are_found_by_san_and_by_token() {
        let p = policy(&format!(
            r#"
            [[identity]]
            name = "gw"
            roles = ["frontend"]
            san = ["spiffe://t/gw"]
            [[identity]]
            name = "pool"
            roles = ["worker"]
            san = ["pool.svc"]
            worker_ids = ["10-19", "42"]
            [[identity]]
            name = "dash"
            roles = ["operator-read"]
            token_sha256 = "{TOKEN_DIGEST}"
            "#
        ))
        .unwrap();
        assert_eq!(&*p.by_sans(["x", "spiffe://t/gw"]).unwrap().name, "gw");
        assert_eq!(&*p.by_token("foo").unwrap().name, "dash");
        assert!(p.by_token("food").is_none());
        let pool = p.by_sans(["pool.svc"]).unwrap();
        let ids = pool.worker_ids.as_ref().unwrap();
        assert!(ids.contains(10) && ids.contains(19) && ids.contains(42));
        assert!(!ids.contains(20) && !ids.contains(9) && !ids.contains(41));
        assert!(pool.has(Role::Worker) && !pool.has(Role::Frontend));
    }

    #[test]
    fn mistakes_are_named() {
        let cases = [
            ("", "no [[identity]]"),
            (
                "[[identity]]\nname = \"a\"\nroles = [\"root\"]\nsan = [\"x\"]",
                "unknown variant",
            ),
            (
                "[[identity]]\nname = \"a\"\nroles = [\"worker\"]\nsan = [\"x\"]",
                "needs worker_ids",
            ),
            (
                "[[identity]]\nname = \"a\"\nroles = [\"frontend\"]\nsan = [\"x\"]\nworker_ids = [\"1\"]",
                "without the worker role",
            ),
            (
                "[[identity]]\nname = \"a\"\nroles = [\"frontend\"]",
                "give `san`",
            ),
            (
                "[[identity]]\nname = \"a\"\nroles = [\"frontend\"]\ntoken_sha256 = \"abc\"",
                "64 hex digits",
            ),
            (
                "[[identity]]\nname = \"a\"\nroles = [\"worker\"]\nsan = [\"x\"]\nworker_ids = [\"9-3\"]",
                "runs backwards",
            ),
            (
                "[[identity]]\nname = \"a\"\nroles = [\"frontend\"]\nsan = [\"x\"]\n[[identity]]\nname = \"b\"\nroles = [\"frontend\"]\nsan = [\"x\"]",
                "also \"a\"'s",
            ),
            (
                "[[identity]]\nname = \"a\"\nroles = [\"frontend\"]\nsans = [\"x\"]",
                "unknown field",
            ),
        ];
        for (text, expected) in cases {
            let error = policy(text).unwrap_err();
            assert!(error.contains(expected), "{text:?}: {error}");
        }
    }

    /// #38: worker_ids meant more than it said. `*` beside an id silently
    /// meant any id, `+5` parsed as 5, and `[]` gave a worker identity that
    /// may act for no id at all.
    #[test]
    fn worker_ids_are_read_strictly() {
        let worker = |ids: &str| {
            format!(
                "[[identity]]\nname = \"a\"\nroles = [\"worker\"]\nsan = [\"x\"]\nworker_ids = {ids}"
            )
        };
        for (ids, expected) in [
            (r#"["5", "*"]"#, "`*` must stand alone"),
            (r#"["*", "*"]"#, "`*` must stand alone"),
            (r#"["+5"]"#, "is not an id"),
            (r#"["5-+7"]"#, "is not an id"),
            (r#"["-5"]"#, "is not an id"),
            (r#"["5 6"]"#, "is not an id"),
            ("[]", "names no worker id"),
        ] {
            let error = policy(&worker(ids)).unwrap_err();
            assert!(error.contains(expected), "{ids}: {error}");
        }
        let any = policy(&worker(r#"["*"]"#)).unwrap();
        assert_eq!(any.by_sans(["x"]).unwrap().worker_ids, Some(WorkerIds::Any));
        let spaced = policy(&worker(r#"[" 7 ", "10 - 12"]"#)).unwrap();
        let ids = spaced.by_sans(["x"]).unwrap().worker_ids.clone().unwrap();
        assert!(ids.contains(7) && ids.contains(11) && !ids.contains(8));
    }

    #[test]
    fn two_identities_may_not_share_a_name() {
        let text = "[[identity]]\nname = \"a\"\nroles = [\"frontend\"]\nsan = [\"x\"]\n[[identity]]\nname = \"a\"\nroles = [\"frontend\"]\nsan = [\"y\"]";
        let error = policy(text).unwrap_err();
        assert!(error.contains("another identity has this name"), "{error}");
    }

    #[test]
    fn the_example_policy_in_docs_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/auth-policy.example.toml");
        let p = Policy::load(&path).unwrap();
        for role in [
            Role::Frontend,
            Role::Worker,
            Role::OperatorRead,
            Role::OperatorWrite,
        ] {
            assert!(
                p.identities().iter().any(|i| i.has(role)),
                "no {role} identity"
            );
        }
        assert!(
            p.identities()
                .iter()
                .any(|i| matches!(&i.worker_ids, Some(WorkerIds::Ranges(r)) if r.iter().any(|(lo, hi)| lo < hi)))
        );
        assert!(!p.by_token.is_empty(), "no bearer-token identity");
        assert!(p.by_san.keys().any(|s| s.starts_with("spiffe://")));
    }
}
