//! The reconciler's durable form through a real state file and back.

use std::collections::BTreeMap;
use std::sync::Arc;

use provisioning::effect::{EffectRequest, Operation};
use provisioning::spawn::BoxFuture;
use provisioning::{
    BootParams, ClusterDriver, ClusterShape, DurableState, Generation, GroupId,
    IdempotentEffectExecutor, ManualSpawner, NodeGroup, NodeTemplate, OperationSink, ProviderShape,
    RetryPolicy, RunId, RunOrder, SwarmJoinTemplate, Timestamp,
};
use provisioning::{EffectBackend, EffectError, EffectOutput, LeaseHandle, SubmitError};
use provisioning_journal::codec::{StateCodec, TEMPLATE_PREFIX};
use provisioning_journal::{Journal, SqliteJournal, SqliteOptions};

const RUN: &str = "codec";

fn group(id: &str, count: u32, image: &str) -> NodeGroup {
    NodeGroup {
        id: GroupId::new(id),
        run_id: RunId::new(RUN),
        count,
        template: NodeTemplate {
            role: "worker".into(),
            provider: "any".into(),
            shape: ProviderShape {
                image: image.into(),
                resources: BTreeMap::from([("cpu".into(), 2.5)]),
                labels: BTreeMap::from([("tier".into(), "a".into())]),
            },
            boot: BootParams::default(),
            swarm_join: SwarmJoinTemplate::default(),
        },
    }
}

fn shape(generation: u64, groups: Vec<NodeGroup>) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new(RUN),
        generation: Generation::new(generation),
        groups,
    }
}

/// Creates leases and fails nothing else: a mix of nodes with facts, pending
/// operations and retry state.
struct Leases;

impl EffectBackend for Leases {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        let out = match operation.request {
            EffectRequest::CreateLease if operation.node.index() % 2 == 0 => {
                Ok(EffectOutput::LeaseCreated {
                    lease: LeaseHandle(format!("lease \"{}\" ü", operation.node)),
                    endpoint: None,
                    adopted: false,
                })
            }
            _ => Err(EffectError::ambiguous("no answer")),
        };
        Box::pin(async move { out })
    }
}

struct Journaled<'a> {
    executor: &'a IdempotentEffectExecutor<Leases>,
}

impl OperationSink for Journaled<'_> {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        self.executor.submit(operation).map(|_| ())
    }
}

#[test]
fn a_driver_state_committed_in_change_sets_reads_back_equal_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut journal = SqliteJournal::open(dir.path(), RUN, &SqliteOptions::default()).unwrap();
    let mut codec = StateCodec::new();
    let spawner = ManualSpawner::new();
    let executor = IdempotentEffectExecutor::new(Arc::new(Leases), Arc::new(spawner.clone()));
    let mut driver = ClusterDriver::new(RunId::new(RUN), RetryPolicy::default()).unwrap();
    driver.track_changes();
    driver
        .update_desired(shape(1, vec![group("a", 4, "x"), group("b", 3, "y")]))
        .unwrap();
    let now = Timestamp::from_millis(7);
    for round in 0..3 {
        driver
            .drive_until_blocked(
                now,
                &mut Journaled {
                    executor: &executor,
                },
            )
            .unwrap();
        let rows = codec
            .encode(&driver.take_changes(now).to_owned_changes())
            .unwrap();
        journal.commit(&rows).unwrap();
        spawner.run_all(RunOrder::Fifo);
        for result in executor.take_results() {
            driver.apply_executor_result(&result, now).unwrap();
        }
        if round == 1 {
            // A drift and a scale-down: new templates, removed nodes.
            driver
                .update_desired(shape(2, vec![group("a", 2, "x2")]))
                .unwrap();
        }
    }
    let rows = codec
        .encode(&driver.take_changes(now).to_owned_changes())
        .unwrap();
    journal.commit(&rows).unwrap();
    drop(journal);

    let journal = SqliteJournal::open(dir.path(), RUN, &SqliteOptions::default()).unwrap();
    let snapshot = journal.load().unwrap();
    let templates = snapshot
        .meta
        .keys()
        .filter(|k| k.starts_with(TEMPLATE_PREFIX))
        .count();
    assert_eq!(templates, 2, "each distinct template is stored once");
    let decoded: DurableState = StateCodec::new().decode(&snapshot).unwrap().unwrap();
    let mut expected = driver.durable_state(now);
    let key = |s: &mut DurableState| s.nodes.sort_by(|a, b| a.node.node.cmp(&b.node.node));
    key(&mut expected);
    let mut decoded = decoded;
    key(&mut decoded);
    assert_eq!(decoded, expected);
}

#[test]
fn a_blank_journal_decodes_to_nothing_and_a_row_without_its_template_is_an_error() {
    let mut journal = provisioning_journal::MemoryJournal::new(RUN).unwrap();
    assert_eq!(
        StateCodec::new().decode(&journal.load().unwrap()).unwrap(),
        None
    );
    let mut driver = ClusterDriver::new(RunId::new(RUN), RetryPolicy::default()).unwrap();
    driver.track_changes();
    driver
        .update_desired(shape(1, vec![group("a", 1, "x")]))
        .unwrap();
    let _ = driver.drive_until_blocked(Timestamp::ZERO, &mut Discard);
    let mut rows = StateCodec::new()
        .encode(&driver.take_changes(Timestamp::ZERO).to_owned_changes())
        .unwrap();
    rows.meta.retain(|(k, _)| !k.starts_with(TEMPLATE_PREFIX));
    journal.commit(&rows).unwrap();
    let error = StateCodec::new()
        .decode(&journal.load().unwrap())
        .unwrap_err();
    assert!(error.to_string().contains("a-0"), "{error}");
}

struct Discard;

impl OperationSink for Discard {
    fn submit(&mut self, _operation: Operation) -> Result<(), SubmitError> {
        Ok(())
    }
}

#[test]
fn a_change_set_borrowed_from_the_driver_encodes_to_the_rows_of_its_owned_form() {
    let mut borrowed_codec = StateCodec::new();
    let mut owned_codec = StateCodec::new();
    let spawner = ManualSpawner::new();
    let executor = IdempotentEffectExecutor::new(Arc::new(Leases), Arc::new(spawner.clone()));
    let mut driver = ClusterDriver::new(RunId::new(RUN), RetryPolicy::default()).unwrap();
    driver.track_changes();
    driver
        .update_desired(shape(1, vec![group("a", 4, "x"), group("b", 3, "y")]))
        .unwrap();
    let now = Timestamp::from_millis(11);
    let mut rows_seen = 0;
    for round in 0..4 {
        driver
            .drive_until_blocked(
                now,
                &mut Journaled {
                    executor: &executor,
                },
            )
            .unwrap();
        let view = driver.take_changes(now);
        let owned = view.to_owned_changes();
        let borrowed_rows = borrowed_codec.encode_view(&view).unwrap();
        drop(view);
        let owned_rows = owned_codec.encode(&owned).unwrap();
        assert_eq!(borrowed_rows, owned_rows, "round {round}");
        rows_seen += owned_rows.upserts.len() + owned_rows.deletes.len();
        spawner.run_all(RunOrder::Fifo);
        for result in executor.take_results() {
            driver.apply_executor_result(&result, now).unwrap();
        }
        if round == 1 {
            driver
                .update_desired(shape(2, vec![group("a", 2, "x2")]))
                .unwrap();
        }
    }
    // Both forms were compared on real rows: leases, ambiguous creates,
    // drifted templates and removed nodes.
    assert!(rows_seen >= 14, "only {rows_seen} rows compared");
    assert!(
        driver.take_changes(now).is_empty(),
        "a view takes the changes"
    );
}
