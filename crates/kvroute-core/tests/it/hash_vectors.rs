//! Bit-for-bit compatibility of `hashing::compute_block_hashes` with
//! `dynamo_kv_router::protocols::compute_block_hash_for_seq` (1.6.1).
//!
//! `committed_vectors` checks the vectors in `tests/data/hash_vectors.json`
//! (generated from Dynamo's function) on every run. With the `dynamo-compare`
//! feature, `matches_dynamo` also calls Dynamo directly and
//! `generate_vectors` (ignored; run with `--ignored`) rewrites that file:
//!
//!     cargo test --features dynamo-compare --test hash_vectors -- --include-ignored

use kvroute_core::hashing::{HashOptions, compute_block_hashes};
use serde_json::Value;

const VECTORS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/hash_vectors.json");

#[test]
fn committed_vectors() -> Result<(), Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(VECTORS)?;
    let all: Vec<Value> = serde_json::from_str(&text)?;
    assert!(all.len() >= 15);
    for v in &all {
        let u64s = |x: &Value| -> Vec<u64> {
            x.as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default()
        };
        let toks: Vec<u32> = u64s(&v["tokens"]).into_iter().map(|t| t as u32).collect();
        let mm: Option<Vec<Vec<u64>>> = v["block_mm_hashes"]
            .as_array()
            .map(|a| a.iter().map(u64s).collect());
        let opts = HashOptions {
            lora_name: v["lora_name"].as_str(),
            cache_namespace: v["cache_namespace"].as_str(),
        };
        let bs = v["block_size"].as_u64().unwrap_or(0) as u32;
        let got = compute_block_hashes(&toks, bs, &opts, mm.as_deref());
        assert_eq!(got, u64s(&v["hashes"]), "vector {}", v["name"]);
    }
    Ok(())
}

#[cfg(feature = "dynamo-compare")]
mod against_dynamo {
    use super::*;
    use dynamo_kv_router::protocols::{
        BlockExtraInfo, BlockHashOptions, BlockMmObjectInfo, compute_block_hash_for_seq,
    };

    use kvroute_core::hashing::{HashOptions, compute_block_hashes};
    use serde_json::{Value, json};

    struct Case {
        name: String,
        block_size: u32,
        lora: Option<&'static str>,
        namespace: Option<&'static str>,
        tokens: Vec<u32>,
        mm: Option<Vec<Vec<u64>>>,
    }

    fn tokens(seed: u64, n: usize) -> Vec<u32> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 33) as u32 % 200_000
            })
            .collect()
    }

    fn cases() -> Vec<Case> {
        let mut out = Vec::new();
        let ids: [(Option<&'static str>, Option<&'static str>, &str); 5] = [
            (None, None, "plain"),
            (Some("my-lora"), None, "lora"),
            (None, Some("tenant-a"), "namespace"),
            (Some("my-lora"), Some("tenant-a"), "lora+namespace"),
            (Some(""), Some(""), "empty-strings"),
        ];
        for (i, &bs) in [1u32, 16, 64].iter().enumerate() {
            for (j, (lora, ns, label)) in ids.iter().enumerate() {
                let n = bs as usize * 3 + bs as usize / 2 + j % 2;
                out.push(Case {
                    name: format!("{label} bs={bs}"),
                    block_size: bs,
                    lora: *lora,
                    namespace: *ns,
                    tokens: tokens((i * 10 + j) as u64, n),
                    mm: None,
                });
            }
            let n = bs as usize * 4 + 1;
            out.push(Case {
                name: format!("multimodal bs={bs}"),
                block_size: bs,
                lora: Some("vision-lora"),
                namespace: None,
                tokens: tokens(100 + i as u64, n),
                mm: Some(vec![
                    vec![u64::MAX - 7, 42],
                    vec![],
                    vec![9_000_000_000_000_000_001],
                ]),
            });
            out.push(Case {
                name: format!("empty bs={bs}"),
                block_size: bs,
                lora: None,
                namespace: None,
                tokens: tokens(200, bs as usize - 1 + usize::from(bs == 1)),
                mm: None,
            });
        }
        out
    }

    fn ours(c: &Case) -> Vec<u64> {
        let opts = HashOptions {
            lora_name: c.lora,
            cache_namespace: c.namespace,
        };
        compute_block_hashes(&c.tokens, c.block_size, &opts, c.mm.as_deref())
    }

    fn dynamo(c: &Case) -> Vec<u64> {
        let infos: Option<Vec<Option<BlockExtraInfo>>> = c.mm.as_ref().map(|all| {
            all.iter()
                .map(|hs| {
                    (!hs.is_empty()).then(|| BlockExtraInfo {
                        mm_objects: hs
                            .iter()
                            .map(|&h| BlockMmObjectInfo {
                                mm_hash: h,
                                offsets: vec![(0, 1)],
                            })
                            .collect(),
                    })
                })
                .collect()
        });
        let opts = BlockHashOptions {
            block_mm_infos: infos.as_deref(),
            lora_name: c.lora,
            cache_namespace: c.namespace,
            is_eagle: None,
        };
        compute_block_hash_for_seq(&c.tokens, c.block_size, opts)
            .into_iter()
            .map(|h| h.0)
            .collect()
    }

    #[test]
    fn matches_dynamo() {
        for c in cases() {
            assert_eq!(ours(&c), dynamo(&c), "case {}", c.name);
        }
    }

    #[test]
    #[ignore = "rewrites tests/data/hash_vectors.json from Dynamo's function"]
    fn generate_vectors() -> Result<(), Box<dyn std::error::Error>> {
        let all: Vec<Value> = cases()
            .iter()
            .map(|c| {
                json!({
                    "name": c.name,
                    "block_size": c.block_size,
                    "lora_name": c.lora,
                    "cache_namespace": c.namespace,
                    "tokens": c.tokens,
                    "block_mm_hashes": c.mm,
                    "hashes": dynamo(c),
                })
            })
            .collect();
        std::fs::write(
            VECTORS,
            serde_json::to_string_pretty(&Value::Array(all))? + "\n",
        )?;
        Ok(())
    }
}
