//! What the host reports to a metrics recorder (design §15).
//!
//! The host speaks only the `metrics` facade; whoever runs it installs a
//! recorder (the CLI's `--metrics ADDR` installs a Prometheus exporter).
//! With no recorder installed every call here is a cheap no-op, and a host
//! whose [`crate::HostConfig::metrics`] is off does not even look up an
//! operation's latency.
//!
//! | name | type | labels |
//! |---|---|---|
//! | `provision_nodes_desired` | gauge | `group` |
//! | `provision_nodes_ready` | gauge | `group` |
//! | `provision_nodes` | gauge | `group`, `stage` (`deleting` for nodes being removed; `rejoining` for nodes recovered after a restart whose agent has not re-joined: never counted ready) |
//! | `provision_group_paused` | gauge (0/1) | `group` |
//! | `provision_operations_total` | counter | `kind`, `outcome` (`ok`, `definite`, `ambiguous`) |
//! | `provision_operation_duration_seconds` | histogram | `kind` |
//! | `provision_drive_duration_seconds` | histogram | — |
//! | `provision_passes_total` | counter | — |
//! | `provision_orphans_collected_total` | counter | — |

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use provisioning::effect::{Disposition, ExecutorResult};

use crate::status::StatusSnapshot;

/// Counts one operation result, with its latency when known.
pub(crate) fn operation(result: &ExecutorResult, latency: Option<Duration>) {
    let outcome = match &result.outcome {
        Ok(_) => "ok",
        Err(error) if error.disposition == Disposition::Definite => "definite",
        Err(_) => "ambiguous",
    };
    let kind = result.kind.name();
    metrics::counter!("provision_operations_total", "kind" => kind, "outcome" => outcome)
        .increment(1);
    if let Some(latency) = latency {
        metrics::histogram!("provision_operation_duration_seconds", "kind" => kind)
            .record(latency.as_secs_f64());
    }
}

/// Records one drive of the driver (its passes and how long it took).
pub(crate) fn drive(passes: u32, took: Duration) {
    metrics::counter!("provision_passes_total").increment(u64::from(passes));
    metrics::histogram!("provision_drive_duration_seconds").record(took.as_secs_f64());
}

/// Sets the gauges from a published snapshot. `previous` holds the label
/// sets set last time, so that a stage no node is in any more reads 0
/// rather than its last value.
pub(crate) fn gauges(snapshot: &StatusSnapshot, previous: &mut BTreeSet<(String, String)>) {
    for group in &snapshot.groups {
        let id = group.id.clone();
        metrics::gauge!("provision_nodes_desired", "group" => id.clone())
            .set(f64::from(group.desired));
        metrics::gauge!("provision_nodes_ready", "group" => id.clone()).set(f64::from(group.ready));
        metrics::gauge!("provision_group_paused", "group" => id).set(if group.paused.is_some() {
            1.0
        } else {
            0.0
        });
    }
    if let Some(durability) = &snapshot.durability {
        metrics::counter!("provision_orphans_collected_total")
            .absolute(durability.orphans_collected);
    }
    let mut counts: BTreeMap<(String, String), u64> = BTreeMap::new();
    for node in &snapshot.nodes {
        let stage = if node.deleting {
            "deleting".to_owned()
        } else {
            node.stage.clone()
        };
        *counts.entry((node.group.clone(), stage)).or_default() += 1;
    }
    for key in previous.iter() {
        if !counts.contains_key(key) {
            let (group, stage) = key.clone();
            metrics::gauge!("provision_nodes", "group" => group, "stage" => stage).set(0.0);
        }
    }
    previous.clear();
    for ((group, stage), count) in counts {
        #[allow(clippy::cast_precision_loss)]
        let value = count as f64;
        metrics::gauge!("provision_nodes", "group" => group.clone(), "stage" => stage.clone())
            .set(value);
        previous.insert((group, stage));
    }
}
