//! The decoder fuzzed end to end: a program (`tests/doubles/scripted_provider.py`)
//! writes seeded random garbage — random bytes, broken JSON, objects of the
//! wrong kind, over-long lines, replies to ids not in flight — and then a
//! malformed reply to the call in flight. Every such call must fail
//! **definitely**, the garbage around it must be ignored, the program must
//! keep running, and nothing may panic or hang. Calls whose reply never
//! comes (only garbage) must fail **ambiguous** once the call timeout passes.
//!
//! The generator is a seeded SplitMix64, so a failure reproduces exactly;
//! the seed is in the test.

use std::time::Duration;

use provisioning::RunId;
use provisioning_conformance::SplitMix64;
use provisioning_exec::{ExecConfig, ExecPlugin};
use provisioning_provider::{PluginError, ProvisionPlugin};
use serde_json::{Map, Value, json};

const DOUBLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/doubles/scripted_provider.py"
);

const SEED: u64 = 0x0bad_0de5;
/// Calls answered with a malformed reply.
const MALFORMED_CALLS: usize = 300;
/// Calls answered with garbage only.
const UNANSWERED_CALLS: usize = 3;
/// Short, so that the unanswered calls end soon; generous for a busy machine
/// answering the others.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// A bound that only a hang reaches.
const TEST_BOUND: Duration = Duration::from_secs(240);

/// Object keys the generator uses: never `nodes` or `disposition`, so a
/// generated value can never be a well-formed `list_nodes` result or error.
const KEYS: &[&str] = &[
    "lease", "endpoint", "adopted", "ready", "session", "key", "run", "message", "x", "",
];

fn random_string(rng: &mut SplitMix64) -> String {
    const CHARS: &[char] = &[
        'a', 'z', '0', ' ', '"', '\\', '\n', 'é', '\u{1}', '\u{2028}',
    ];
    (0..rng.below(8))
        .map(|_| CHARS[rng.below(CHARS.len() as u64) as usize])
        .collect()
}

fn random_json(rng: &mut SplitMix64, depth: u32) -> Value {
    let kinds = if depth == 0 { 4 } else { 6 };
    match rng.below(kinds) {
        0 => Value::Null,
        1 => Value::Bool(rng.chance(500)),
        2 => match rng.below(3) {
            0 => json!(rng.next_u64()),
            1 => json!(-(rng.below(1_000) as i64)),
            _ => json!(rng.below(1_000) as f64 / 7.0),
        },
        3 => Value::String(random_string(rng)),
        4 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_json(rng, depth - 1))
                .collect(),
        ),
        _ => Value::Object(random_object(rng, depth - 1)),
    }
}

fn random_object(rng: &mut SplitMix64, depth: u32) -> Map<String, Value> {
    (0..rng.below(4))
        .map(|_| {
            let key = KEYS[rng.below(KEYS.len() as u64) as usize].to_owned();
            (key, random_json(rng, depth))
        })
        .collect()
}

/// A reply to the id in flight (`@ID@`) that the host must refuse.
fn malformed_reply(rng: &mut SplitMix64) -> String {
    let body = match rng.below(6) {
        0 => format!("\"result\":{}", random_json(rng, 3)),
        1 => format!("\"error\":{}", random_json(rng, 3)),
        2 => format!(
            "\"result\":{},\"error\":{}",
            random_json(rng, 2),
            random_json(rng, 2)
        ),
        3 => {
            // Neither result nor error.
            let extra = Value::Object(random_object(rng, 2)).to_string();
            extra[1..extra.len() - 1].to_owned()
        }
        4 => {
            // `nodes` that is not a list.
            let nodes = match random_json(rng, 2) {
                Value::Array(_) => Value::Bool(true),
                other => other,
            };
            format!("\"result\":{{\"nodes\":{nodes}}}")
        }
        _ => {
            // A listed node without a key.
            let mut node = random_object(rng, 2);
            node.remove("key");
            format!("\"result\":{{\"nodes\":[{}]}}", Value::Object(node))
        }
    };
    let body = body.trim_start_matches(',');
    if body.is_empty() {
        "{\"id\":@ID@}".to_owned()
    } else {
        format!("{{\"id\":@ID@,{body}}}")
    }
}

/// A line the host must log and ignore.
fn junk_line(rng: &mut SplitMix64) -> Vec<u8> {
    match rng.below(8) {
        0 => (0..rng.below(120))
            .map(|_| match rng.next_u64() as u8 {
                b'\n' => b'?',
                byte => byte,
            })
            .collect(),
        1 => {
            // A valid reply to an id that is not in flight, then mutated.
            let mut line = br#"{"id":9999999,"result":{"nodes":[]}}"#.to_vec();
            for _ in 0..rng.below(3) {
                let at = rng.below(line.len() as u64) as usize;
                line[at] = match rng.next_u64() as u8 {
                    b'\n' => b'!',
                    byte => byte,
                };
            }
            line
        }
        2 => match random_json(rng, 3) {
            Value::Object(_) => b"[]".to_vec(),
            other => other.to_string().into_bytes(),
        },
        3 => Value::Object(random_object(rng, 2))
            .to_string()
            .into_bytes(),
        4 => format!(
            "{{\"observation\":{},\"key\":{}}}",
            random_json(rng, 1),
            random_json(rng, 2)
        )
        .into_bytes(),
        5 => format!("{{\"id\":{}}}", random_json(rng, 1)).into_bytes(),
        6 if rng.chance(60) => vec![b'x'; (1 << 20) + 1 + rng.below(100) as usize],
        _ => b"{\"id\":-1,\"result\":{}}".to_vec(),
    }
}

/// The script entries and, for each call, whether it gets a reply.
fn script(rng: &mut SplitMix64) -> (Value, Vec<bool>) {
    let mut entries = Vec::new();
    let mut answered = Vec::new();
    let total = MALFORMED_CALLS + UNANSWERED_CALLS;
    for n in 0..total {
        // The unanswered calls are spread through the run.
        let reply = n % (total / UNANSWERED_CALLS) != total / UNANSWERED_CALLS - 1;
        let junk: Vec<Value> = (0..rng.below(4))
            .map(|_| Value::String(hex::encode(junk_line(rng))))
            .collect();
        entries.push(json!({
            "junk": junk,
            "reply": if reply { Value::String(hex::encode(malformed_reply(rng).as_bytes())) } else { Value::Null },
        }));
        answered.push(reply);
    }
    (Value::Array(entries), answered)
}

#[test]
fn the_generator_never_makes_a_well_formed_reply() {
    let mut rng = SplitMix64::new(SEED ^ 1);
    for _ in 0..5_000 {
        let line = malformed_reply(&mut rng).replace("@ID@", "1");
        let decoded = provisioning_exec::wire::decode_line(line.as_bytes());
        if let Ok(provisioning_exec::wire::Message::Reply {
            outcome: Ok(value), ..
        }) = &decoded
        {
            let nodes = value.get("nodes");
            assert!(
                !matches!(nodes, Some(Value::Array(list)) if list.iter().all(|n| n.get("key").is_some())),
                "{line}"
            );
        } else {
            assert!(
                matches!(
                    decoded,
                    Err(provisioning_exec::wire::DecodeError::BadReply { id: 1, .. })
                ),
                "{line}: {decoded:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_output_fails_its_call_definitely_and_garbage_never_panics_or_hangs() {
    let dir = tempfile_dir();
    let path = dir.join("script.json");
    let mut rng = SplitMix64::new(SEED);
    let (entries, answered) = script(&mut rng);
    std::fs::write(&path, entries.to_string()).expect("the script is written");

    let plugin = ExecPlugin::new(
        ExecConfig::new("python3", [DOUBLE.to_owned(), path.display().to_string()])
            .with_call_timeout(CALL_TIMEOUT),
    );
    let run = RunId::new("fuzz");
    let checked = tokio::time::timeout(TEST_BOUND, async {
        for (n, reply) in answered.iter().enumerate() {
            let outcome = plugin.list_nodes(&run).await;
            if *reply {
                assert!(
                    matches!(outcome, Err(PluginError::Definite(_))),
                    "call {n}: a malformed reply must fail its call definitely, got {outcome:?}"
                );
            } else {
                assert!(
                    matches!(outcome, Err(PluginError::Ambiguous(_))),
                    "call {n}: a call never answered must fail ambiguous, got {outcome:?}"
                );
            }
        }
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        checked.is_ok(),
        "the calls did not end within {TEST_BOUND:?}"
    );
    assert_eq!(
        plugin.start_count(),
        1,
        "malformed output must not cost the program its life"
    );
}

/// A fresh directory under the system's temporary directory.
fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "provisioning-exec-fuzz-{}-{}",
        std::process::id(),
        SEED
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    dir
}
