//! An auth policy file: the fuzz bytes are its TOML text, read as
//! `--auth-policy` reads it. A policy that loads must say exactly what its
//! text says: identities with distinct names, each with a role, worker ids
//! for exactly the `worker` identities and only then, never an empty or
//! backwards range; and reading the same text twice gives the same policy.

use crate::security::policy::{Policy, Role, WorkerIds};

pub fn auth_policy(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(policy) = Policy::parse(text) else {
        return;
    };
    let identities = policy.identities();
    let mut names = std::collections::HashSet::new();
    for identity in identities {
        assert!(names.insert(identity.name.clone()), "a name twice");
        assert!(!identity.roles.is_empty(), "an identity without a role");
        assert_eq!(
            identity.worker_ids.is_some(),
            identity.has(Role::Worker),
            "worker ids exactly for worker identities"
        );
        if let Some(WorkerIds::Ranges(ranges)) = &identity.worker_ids {
            assert!(!ranges.is_empty(), "a worker identity acting for no id");
            assert!(ranges.iter().all(|(lo, hi)| lo <= hi), "a backwards range");
        }
        // Lookups answer, whatever was asked.
        let _ = policy.by_sans([identity.name.as_ref()]);
        let _ = policy.by_token(&identity.name);
    }
    let again = Policy::parse(text).map(|p| p.identities().len());
    assert_eq!(
        again,
        Ok(identities.len()),
        "the same text, the same policy"
    );
}
