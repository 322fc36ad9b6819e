//! Tokio host for `provisioning` (work in progress).
