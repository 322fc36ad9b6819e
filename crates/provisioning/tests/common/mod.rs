//! Shared fixtures for the core crate's tests.
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use provisioning::driver::OperationSink;
use provisioning::effect::EffectRequest;
use provisioning::executor::EffectBackend;
use provisioning::spawn::BoxFuture;
use provisioning::{
    BootParams, BootstrapEvent, ClusterDriver, ClusterShape, EffectError, EffectKind, EffectOutput,
    Endpoint, EndpointLookup, ExecutorResult, Generation, GroupId, LeaseHandle, LogicalNodeId,
    NodeGroup, NodeTemplate, Observation, Operation, ProviderShape, RetryPolicy, RunId,
    SessionHandle, SubmitError, SwarmJoinTemplate, Timestamp,
};

pub const RUN: &str = "run";

pub fn template(image: &str) -> NodeTemplate {
    NodeTemplate {
        role: "worker".into(),
        provider: "fake".into(),
        shape: ProviderShape {
            image: image.into(),
            resources: BTreeMap::from([("cpu".into(), 1.0)]),
            labels: BTreeMap::new(),
        },
        boot: BootParams::default(),
        swarm_join: SwarmJoinTemplate::default(),
    }
}

pub fn group(id: &str, count: u32, image: &str) -> NodeGroup {
    NodeGroup {
        id: GroupId::new(id),
        run_id: RunId::new(RUN),
        count,
        template: template(image),
    }
}

pub fn shape(generation: u64, groups: Vec<NodeGroup>) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new(RUN),
        generation: Generation::new(generation),
        groups,
    }
}

pub fn node(id: &str) -> LogicalNodeId {
    LogicalNodeId::parse(id).unwrap()
}

pub fn at(ms: u64) -> Timestamp {
    Timestamp::from_millis(ms)
}

pub fn driver() -> ClusterDriver {
    ClusterDriver::new(RunId::new(RUN), RetryPolicy::default()).unwrap()
}

/// A sink that records operations and can refuse them.
#[derive(Default)]
pub struct RecordingSink {
    pub submitted: Vec<Operation>,
    pub retired: Vec<provisioning::NodeAttemptId>,
    pub refuse: bool,
}

impl OperationSink for RecordingSink {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        if self.refuse {
            return Err(SubmitError::Closed);
        }
        self.submitted.push(operation);
        Ok(())
    }

    fn attempt_retired(&mut self, attempt: provisioning::NodeAttemptId) {
        self.retired.push(attempt);
    }
}

impl RecordingSink {
    pub fn take(&mut self) -> Vec<Operation> {
        std::mem::take(&mut self.submitted)
    }

    pub fn kinds(&self) -> Vec<(String, EffectKind)> {
        self.submitted
            .iter()
            .map(|op| (op.node.to_string(), op.kind()))
            .collect()
    }
}

/// The natural successful answer to an operation.
pub fn success(op: &Operation) -> ExecutorResult {
    let key = format!("{}-{}", op.node, op.attempt());
    let output = match &op.request {
        EffectRequest::CreateLease => EffectOutput::LeaseCreated {
            lease: LeaseHandle(format!("lease-{key}")),
            endpoint: None,
            adopted: false,
        },
        EffectRequest::LookupEndpoint { .. } => {
            EffectOutput::Endpoint(EndpointLookup::Ready(Endpoint(format!("ep-{key}"))))
        }
        EffectRequest::StartBootstrap { .. } => EffectOutput::BootstrapStarted {
            session: SessionHandle(format!("session-{key}")),
            adopted: false,
        },
        EffectRequest::BootstrapConvergenceObserved { .. } => EffectOutput::ConvergenceAcknowledged,
        EffectRequest::CancelBootstrap { .. } => EffectOutput::BootstrapCancelled,
        EffectRequest::DestroyLease { .. } => EffectOutput::LeaseDestroyed,
    };
    reply(op, Ok(output))
}

pub fn reply(op: &Operation, outcome: Result<EffectOutput, EffectError>) -> ExecutorResult {
    ExecutorResult {
        op: op.id,
        node: op.node.clone(),
        kind: op.kind(),
        outcome,
    }
}

pub fn bootstrap(op: &Operation, event: BootstrapEvent) -> Observation {
    Observation::Bootstrap {
        node: op.node.clone(),
        attempt: op.attempt(),
        event,
    }
}

/// Drives `driver` until every desired node is ready, answering every
/// operation with success and playing the bootstrap stream. Returns the
/// operations seen.
pub fn converge(
    driver: &mut ClusterDriver,
    sink: &mut RecordingSink,
    now: Timestamp,
) -> Vec<Operation> {
    let mut seen = Vec::new();
    for _ in 0..64 {
        driver.drive_until_blocked(now, sink).unwrap();
        let ops = sink.take();
        if ops.is_empty() {
            break;
        }
        for op in ops {
            driver.apply_executor_result(&success(&op), now).unwrap();
            if op.kind() == EffectKind::StartBootstrap {
                driver
                    .apply_observation(&bootstrap(&op, BootstrapEvent::Joined), now)
                    .unwrap();
            }
            if op.kind() == EffectKind::BootstrapConvergenceObserved {
                driver
                    .apply_observation(&bootstrap(&op, BootstrapEvent::Closed), now)
                    .unwrap();
            }
            seen.push(op);
        }
    }
    seen
}

/// A backend whose answers tests script; it records calls.
#[derive(Default)]
pub struct ScriptedBackend {
    pub calls: Mutex<Vec<Operation>>,
    pub panic_on: Mutex<Option<EffectKind>>,
}

impl EffectBackend for ScriptedBackend {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        Box::pin(async move {
            self.calls.lock().unwrap().push(operation.clone());
            if *self.panic_on.lock().unwrap() == Some(operation.kind()) {
                panic!("scripted panic");
            }
            success(operation).outcome
        })
    }
}

pub fn shared<T>(value: T) -> Arc<T> {
    Arc::new(value)
}

/// Runs `driver` until blocked and returns what it submitted.
pub fn drive(
    driver: &mut ClusterDriver,
    sink: &mut RecordingSink,
    now: Timestamp,
) -> Vec<Operation> {
    driver.drive_until_blocked(now, sink).unwrap();
    sink.take()
}

/// The single operation of `ops`, which must be of `kind`.
pub fn one(ops: Vec<Operation>, kind: EffectKind) -> Operation {
    assert_eq!(ops.len(), 1, "expected one operation, got {ops:?}");
    let op = ops.into_iter().next().unwrap();
    assert_eq!(op.kind(), kind);
    op
}

/// Brings the one node of `driver`'s shape to a started bootstrap session
/// at `now` (create, lookup and start answered); returns the start.
pub fn started(driver: &mut ClusterDriver, sink: &mut RecordingSink, now: Timestamp) -> Operation {
    let create = one(drive(driver, sink, now), EffectKind::CreateLease);
    driver
        .apply_executor_result(&success(&create), now)
        .unwrap();
    let lookup = one(drive(driver, sink, now), EffectKind::LookupEndpoint);
    driver
        .apply_executor_result(&success(&lookup), now)
        .unwrap();
    let start = one(drive(driver, sink, now), EffectKind::StartBootstrap);
    driver.apply_executor_result(&success(&start), now).unwrap();
    start
}

/// A driver that tracks changes, with `groups` desired at generation 1.
pub fn tracked(groups: Vec<NodeGroup>) -> ClusterDriver {
    let mut d = driver();
    d.track_changes();
    d.update_desired(shape(1, groups)).unwrap();
    d
}
