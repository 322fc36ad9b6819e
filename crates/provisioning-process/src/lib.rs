//! Local process provider for `provisioning` (work in progress).
