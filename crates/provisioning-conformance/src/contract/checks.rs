//! The contracts themselves, one method of `ContractRun` each, in the
//! order of the table in the module's documentation.

use provisioning::effect::{EffectRequest, SessionHandle};
use provisioning::executor::EffectBackend;
use provisioning::id::OperationSequence;
use provisioning::{EffectOutput, LeaseHandle, Observation, Operation, OperationId, RunId};
use provisioning_provider::{AttemptKey, BootstrapRequest, ListedNode, PluginError};

use super::report::Contract;
use super::run::{
    ContractRun, LOSS_REPORT_POLLS_MAX, NEVER_ISSUED, Step, describe_fact, describe_facts,
    describe_leases, fail, skip,
};
use super::subject::PluginMethod;
use crate::trace::Fault;

impl ContractRun {
    pub(super) async fn check(&self, contract: Contract) -> Step {
        match contract {
            Contract::CreateTwiceAdopts => self.create_twice_adopts().await,
            Contract::DefiniteFaultCreatesNothing => self.definite_fault_creates_nothing().await,
            Contract::DefiniteFaultAdoptsExisting => self.definite_fault_adopts_existing().await,
            Contract::AmbiguousFaultRetryAdopts => self.ambiguous_fault_retry_adopts().await,
            Contract::StartTwiceAdopts => self.start_twice_adopts().await,
            Contract::CleanupOfAbsentSucceeds => self.cleanup_of_absent_succeeds().await,
            Contract::CleanupFaultsRetry => self.cleanup_faults_retry().await,
            Contract::ListIsExact => self.list_is_exact().await,
            Contract::TeardownLeavesNothing => self.teardown_leaves_nothing().await,
            Contract::SupersededFactsDropped => self.superseded_facts_dropped().await,
        }
    }

    async fn create_twice_adopts(&self) -> Step {
        let key = self.key(0, 1);
        let first = self.create_ok(&key, "the first create").await?;
        if first.adopted {
            return fail(format!(
                "the first create_node of {key} on a fresh plugin claimed to adopt an existing node"
            ));
        }
        self.expect_listed(
            &key,
            std::slice::from_ref(&first.lease),
            "after one create_node",
        )
        .await?;
        let second = self.create_ok(&key, "the second create").await?;
        if !second.adopted || second.lease != first.lease {
            return fail(format!(
                "a second create_node for {key} did not adopt: it returned lease {} (adopted: {}) while {} was live — create must look for the key's node before creating",
                second.lease.0, second.adopted, first.lease.0
            ));
        }
        self.expect_listed(
            &key,
            std::slice::from_ref(&first.lease),
            "after a second create_node for the same key (it must adopt, not create)",
        )
        .await
    }

    async fn definite_fault_creates_nothing(&self) -> Step {
        self.inject_first(PluginMethod::CreateNode, &[Fault::Definite])?;
        let key = self.key(1, 1);
        match self.create(&key).await {
            Err(PluginError::Definite(_)) => {}
            Ok(lease) => {
                return fail(format!(
                    "create_node of {key} succeeded (lease {}) although a definite fault was injected: the ContractFaults hook did not take effect",
                    lease.lease.0
                ));
            }
            Err(other) => {
                return fail(format!(
                    "create_node of {key} answered {other:?} to an injected definite fault; expected PluginError::Definite"
                ));
            }
        }
        self.expect_listed(
            &key,
            &[],
            "after create_node failed definitely (a definite error must leave nothing behind for its key)",
        )
        .await?;
        let retry = self
            .create_ok(&key, "the retry after a definite fault")
            .await?;
        self.expect_listed(
            &key,
            std::slice::from_ref(&retry.lease),
            "after the retry of a definitely failed create_node",
        )
        .await
    }

    async fn definite_fault_adopts_existing(&self) -> Step {
        let key = self.key(2, 1);
        let live = self.create_ok(&key, "the first create").await?;
        self.inject_first(PluginMethod::CreateNode, &[Fault::Definite])?;
        match self.create(&key).await {
            Ok(again) if again.adopted && again.lease == live.lease => {}
            Ok(again) => {
                return fail(format!(
                    "under an injected definite fault, create_node of {key} returned lease {} (adopted: {}) instead of adopting the live {}",
                    again.lease.0, again.adopted, live.lease.0
                ));
            }
            Err(PluginError::Ambiguous(_)) => {}
            Err(other) => {
                return fail(format!(
                    "create_node of {key} answered {other:?} while its node {} was live: a plugin looks before it fails, so a definite (or not-found) error can never hide an existing node",
                    live.lease.0
                ));
            }
        }
        self.expect_listed(
            &key,
            std::slice::from_ref(&live.lease),
            "after a faulted create_node of a live node",
        )
        .await
    }

    async fn ambiguous_fault_retry_adopts(&self) -> Step {
        let fault = self.inject_first(
            PluginMethod::CreateNode,
            &[Fault::AmbiguousDone, Fault::AmbiguousUndone],
        )?;
        let key = self.key(3, 1);
        match self.create(&key).await {
            Err(PluginError::Ambiguous(_)) => {}
            Ok(lease) => {
                return fail(format!(
                    "create_node of {key} succeeded (lease {}) although an ambiguous fault ({}) was injected: the ContractFaults hook did not take effect",
                    lease.lease.0,
                    fault.name()
                ));
            }
            Err(other) => {
                return fail(format!(
                    "create_node of {key} answered {other:?} to an injected {} fault; expected PluginError::Ambiguous",
                    fault.name()
                ));
            }
        }
        let left = self.listed_for(&key).await?;
        if left.len() > 1 {
            return fail(format!(
                "one ambiguous create_node left {} nodes for {key}: {}",
                left.len(),
                describe_leases(&left)
            ));
        }
        if fault == Fault::AmbiguousDone && left.is_empty() {
            return fail(format!(
                "after a create_node that did its work and then failed ambiguously, list_nodes shows nothing for {key}: either the hook did not do the work or list_nodes misses the node"
            ));
        }
        let retry = self
            .create_ok(&key, "the retry after an ambiguous fault")
            .await?;
        if let Some(existing) = left.first() {
            if !retry.adopted || retry.lease != *existing {
                return fail(format!(
                    "the retry after an ambiguous create_node of {key} returned lease {} (adopted: {}) instead of adopting {}, which the first call left",
                    retry.lease.0, retry.adopted, existing.0
                ));
            }
        }
        self.expect_listed(
            &key,
            std::slice::from_ref(&retry.lease),
            "after the retry of an ambiguous create_node (one node, adopted)",
        )
        .await
    }

    async fn start_twice_adopts(&self) -> Step {
        let key = self.key(4, 1);
        let lease = self
            .create_ok(&key, "creating the node to bootstrap")
            .await?;
        let endpoint = self.endpoint(&key, &lease).await?;
        let request = BootstrapRequest {
            spec: self.spec(&key),
            lease: lease.lease.clone(),
            endpoint,
        };
        let first = match self.plugin().start_bootstrap(&key, &request).await {
            Ok(session) => session,
            Err(error) => {
                return fail(format!(
                    "start_bootstrap of the reachable node {key} failed: {error:?}"
                ));
            }
        };
        if first.adopted {
            return fail(format!(
                "the first start_bootstrap of {key} claimed to adopt an existing session"
            ));
        }
        match self.plugin().start_bootstrap(&key, &request).await {
            Ok(again) if again.adopted && again.session == first.session => {}
            Ok(again) => {
                return fail(format!(
                    "a second start_bootstrap for {key} returned session {} (adopted: {}) instead of adopting the running {} — start must look for the key's session first",
                    again.session.0, again.adopted, first.session.0
                ));
            }
            Err(error) => {
                return fail(format!(
                    "a second start_bootstrap for {key} failed instead of adopting the running session {}: {error:?}",
                    first.session.0
                ));
            }
        }
        self.cancel_ok(&key, Some(&first.session), "cancelling the adopted session")
            .await?;
        self.destroy_ok(&key, &lease.lease, "destroying the bootstrapped node")
            .await?;
        self.expect_listed(&key, &[], "after cancelling and destroying the node")
            .await
    }

    async fn cleanup_of_absent_succeeds(&self) -> Step {
        let never = self.key(5, 1);
        let unknown_session = SessionHandle(NEVER_ISSUED.to_owned());
        let unknown_lease = LeaseHandle(NEVER_ISSUED.to_owned());
        self.cancel_ok(&never, None, "cancelling a session that never existed")
            .await?;
        self.cancel_ok(
            &never,
            Some(&unknown_session),
            "cancelling an unknown session handle",
        )
        .await?;
        self.destroy_ok(
            &never,
            &unknown_lease,
            "destroying a node that never existed",
        )
        .await?;
        let key = self.key(5, 2);
        let lease = self
            .create_ok(&key, "creating a node to destroy twice")
            .await?;
        self.destroy_ok(&key, &lease.lease, "the first destroy")
            .await?;
        self.destroy_ok(&key, &lease.lease, "destroying an already destroyed node")
            .await?;
        self.cancel_ok(&key, None, "cancelling the bootstrap of a destroyed node")
            .await?;
        self.expect_listed(&key, &[], "after destroying the node")
            .await
    }

    async fn cleanup_faults_retry(&self) -> Step {
        let key = self.key(6, 1);
        let lease = self
            .create_ok(&key, "creating a node to fail to destroy")
            .await?;
        let mut checked = Vec::new();
        if self
            .inject_first(PluginMethod::DestroyNode, &[Fault::Definite])
            .is_ok()
        {
            match self.plugin().destroy_node(&key, &lease.lease).await {
                Err(PluginError::Definite(_)) => {}
                other => {
                    return fail(format!(
                        "destroy_node of {key} answered {other:?} to an injected definite fault; expected PluginError::Definite"
                    ));
                }
            }
            self.expect_listed(
                &key,
                std::slice::from_ref(&lease.lease),
                "after destroy_node failed definitely (it certainly did not happen, so the node is still there)",
            )
            .await?;
            checked.push("definite");
        }
        let ambiguous = self.inject_first(
            PluginMethod::DestroyNode,
            &[Fault::AmbiguousDone, Fault::AmbiguousUndone],
        );
        if let Ok(fault) = ambiguous {
            match self.plugin().destroy_node(&key, &lease.lease).await {
                Err(PluginError::Ambiguous(_)) => {}
                other => {
                    return fail(format!(
                        "destroy_node of {key} answered {other:?} to an injected {} fault; expected PluginError::Ambiguous",
                        fault.name()
                    ));
                }
            }
            checked.push("ambiguous");
        }
        if checked.is_empty() {
            return skip(
                "the ContractFaults hook cannot make destroy_node fail definitely or ambiguously",
            );
        }
        self.destroy_ok(&key, &lease.lease, "the retry of a failed destroy")
            .await?;
        self.expect_listed(&key, &[], "after the retry of a failed destroy_node")
            .await
    }

    async fn list_is_exact(&self) -> Step {
        let keys = [self.key(7, 1), self.key(8, 2), self.key(9, 3)];
        let mut expected = Vec::new();
        for key in &keys {
            let lease = self.create_ok(key, "creating the nodes to list").await?;
            expected.push(ListedNode {
                key: key.clone(),
                lease: lease.lease,
            });
        }
        self.expect_exact_listing(&expected, "after creating three nodes")
            .await?;
        let other_run = RunId::new(format!("{}-other", self.run_id()));
        match self.plugin().list_nodes(&other_run).await {
            Ok(listed) if listed.iter().all(|n| n.key.run_id == other_run) => {}
            Ok(listed) => {
                return fail(format!(
                    "list_nodes({other_run}) reported nodes of another run: {listed:?}"
                ));
            }
            Err(error) => return fail(format!("list_nodes({other_run}) failed: {error:?}")),
        }
        let gone = expected.remove(1);
        self.destroy_ok(&gone.key, &gone.lease, "destroying one listed node")
            .await?;
        self.expect_exact_listing(&expected, "after destroying one of three nodes")
            .await
    }

    async fn expect_exact_listing(&self, expected: &[ListedNode], when: &str) -> Step {
        let mut listed = self.listed().await?;
        listed.sort();
        let mut expected = expected.to_vec();
        expected.sort();
        if listed == expected {
            return Ok(());
        }
        let show = |nodes: &[ListedNode]| {
            nodes
                .iter()
                .map(|n| format!("{} ({})", n.key, n.lease.0))
                .collect::<Vec<_>>()
                .join(", ")
        };
        fail(format!(
            "{when}, list_nodes({}) reported [{}]; the live nodes are [{}]",
            self.run_id(),
            show(&listed),
            show(&expected)
        ))
    }

    async fn teardown_leaves_nothing(&self) -> Step {
        let keys = [self.key(10, 1), self.key(11, 1), self.key(12, 2)];
        let mut live = Vec::new();
        for key in &keys {
            live.push((
                key.clone(),
                self.create_ok(key, "creating nodes to tear down").await?,
            ));
        }
        // Bootstrap the first node when it becomes reachable, so that
        // teardown also has a session to end. A plugin whose nodes never
        // become reachable here is torn down without one.
        let (first_key, first_lease) = &live[0];
        let mut session = None;
        if let Ok(endpoint) = self.endpoint(first_key, first_lease).await {
            let request = BootstrapRequest {
                spec: self.spec(first_key),
                lease: first_lease.lease.clone(),
                endpoint,
            };
            session = self
                .plugin()
                .start_bootstrap(first_key, &request)
                .await
                .ok()
                .map(|s| s.session);
        }
        for (key, lease) in &live {
            let handle = if key == first_key {
                session.as_ref()
            } else {
                None
            };
            self.cancel_ok(key, handle, "tearing down").await?;
            self.destroy_ok(key, &lease.lease, "tearing down").await?;
        }
        let left = self.listed().await?;
        if left.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = left
            .iter()
            .map(|n| format!("{} ({})", n.key, n.lease.0))
            .collect();
        fail(format!(
            "after cancelling and destroying every node, list_nodes still shows: {}",
            names.join(", ")
        ))
    }

    /// Runs one effect through the adapter, as the executor would.
    async fn execute(&self, key: &AttemptKey, request: EffectRequest) -> Step<EffectOutput> {
        let operation = Operation {
            id: OperationId::new(key.attempt, OperationSequence::from_raw(1)),
            run_id: key.run_id.clone(),
            node: key.node.clone(),
            spec: self.spec(key),
            request,
        };
        let kind = operation.kind();
        match self.adapter.execute(&operation).await {
            Ok(output) => Ok(output),
            Err(error) => fail(format!(
                "{kind} of {key} through PluginBackendAdapter failed: {error}"
            )),
        }
    }

    async fn superseded_facts_dropped(&self) -> Step {
        let faults = self.faults()?;
        // A loss of a current attempt reaches the driver, under its attempt.
        let current = self.key(13, 1);
        self.execute(&current, EffectRequest::CreateLease).await?;
        let before = self.delivered().len();
        if !faults.lose_node(&current).await {
            return skip("the ContractFaults hook cannot lose a node (lose_node)");
        }
        let about_current =
            |o: &Observation| o.attempt() == current.attempt && *o.node() == current.node;
        let seen = self
            .await_report(before, |facts, _| facts.iter().any(about_current))
            .await;
        let reported = self.delivered().split_off(before);
        if !seen {
            return fail(format!(
                "after its node {current} was lost, the plugin reported nothing for it through the sink within {LOSS_REPORT_POLLS_MAX} looks (reported: {}){}",
                describe_facts(&reported),
                self.pause_hint()
            ));
        }
        if let Some(wrong) = reported.iter().find(|o| !about_current(o)) {
            return fail(format!(
                "the loss of {current} was reported as a fact of another attempt: {}",
                describe_fact(wrong)
            ));
        }
        self.expect_listed(&current, &[], "after the node was lost")
            .await?;

        // A loss of a superseded attempt is dropped at the sink.
        let old = self.key(14, 2);
        let new = self.key(14, 3);
        self.execute(&old, EffectRequest::CreateLease).await?;
        self.execute(&new, EffectRequest::CreateLease).await?;
        let before = self.delivered().len();
        let dropped = self.adapter.sink().dropped_count();
        if !faults.lose_node(&old).await {
            return skip("the ContractFaults hook could not lose a second node");
        }
        let seen = self
            .await_report(before, |facts, now_dropped| {
                now_dropped > dropped || facts.iter().any(|o| *o.node() == old.node)
            })
            .await;
        let reported = self.delivered().split_off(before);
        if let Some(leaked) = reported.iter().find(|o| *o.node() == old.node) {
            return fail(format!(
                "after attempt {} of {} was superseded by {}, the loss of the old node reached the driver as {}: facts must be tagged with the attempt they are about, and a superseded attempt's facts are dropped at the sink",
                old.attempt,
                old.node,
                new.attempt,
                describe_fact(leaked)
            ));
        }
        if !seen {
            return fail(format!(
                "the superseded node {old} was lost but the plugin reported nothing through the sink within {LOSS_REPORT_POLLS_MAX} looks (nothing was dropped){}",
                self.pause_hint()
            ));
        }
        Ok(())
    }
}
