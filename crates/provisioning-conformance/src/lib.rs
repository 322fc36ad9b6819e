//! Conformance kit for `provisioning` (work in progress).
