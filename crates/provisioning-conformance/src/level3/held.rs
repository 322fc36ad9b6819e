//! A call held before it reaches the plugin, as a slow provider API holds
//! it: [`hold_call`].
//!
//! The call runs as a task of the substrate's runtime, so it goes on even
//! when the controller that made it crashed and its executor was dropped —
//! and then may reach the plugin after recovery moved on, and make an
//! orphan, as a slow cloud call would.

use std::sync::Arc;
use std::time::{Duration, Instant};

use provisioning::executor::EffectBackend;
use provisioning::{EffectError, EffectOutput, Operation};
use provisioning_provider::PluginBackendAdapter;

use super::shared::Shared;

/// How often a held call looks whether it was released.
pub const HOLD_POLL_INTERVAL: Duration = Duration::from_millis(2);

/// The longest a call is held (a safety bound; the trace or the teardown
/// releases it long before).
pub const HOLD_WAIT_MAX: Duration = Duration::from_secs(120);

/// Holds `operation` (hang `serial` of `shared`) until the trace releases
/// it or [`HOLD_WAIT_MAX`] passes, then makes it through `adapter`, in a
/// task of the current runtime. A task that ends without an answer is an
/// ambiguous failure.
pub async fn hold_call<F, X, P>(
    shared: &Arc<Shared<F, X, P>>,
    adapter: &Arc<PluginBackendAdapter>,
    serial: u64,
    operation: &Operation,
) -> Result<EffectOutput, EffectError>
where
    F: Send + 'static,
    X: Default + Send + 'static,
    P: Clone + Send + 'static,
{
    let adapter = adapter.clone();
    let shared = shared.clone();
    let operation = operation.clone();
    let call = tokio::spawn(async move {
        let _held = shared.held(serial, operation.id);
        let deadline = Instant::now() + HOLD_WAIT_MAX;
        while !shared.released(serial) && Instant::now() < deadline {
            tokio::time::sleep(HOLD_POLL_INTERVAL).await;
        }
        shared.mark_busy(operation.id);
        adapter.execute(&operation).await
    });
    call.await.unwrap_or_else(|error| {
        Err(EffectError::ambiguous(format!(
            "the held create's task ended without an answer: {error}"
        )))
    })
}
