//! The `ec2` provider of `provisioning`: cloud instances on the EC2 Query
//! API — AWS itself and the clouds and on-prem systems that speak it.
//!
//! Where to start reading: [`Ec2Plugin`] (the seam: a lease is an instance
//! tagged with run, node and attempt; create adopts by tag before it runs an
//! instance with a `ClientToken`), then [`Ec2Client`] (the four API calls,
//! signed by the `sigv4` module, no hidden retries) and [`Ec2Error`] (how a
//! failure is classified: capacity and quota refusals are definite with a
//! reason class; throttling, 5xx and timeouts leave the call's outcome open).
//!
//! # A group on EC2
//!
//! ```toml
//! [providers.ec2]
//! region = "us-east-1"                 # else AWS_REGION / the profile's
//! profile = "gpu"                      # optional: ~/.aws/{config,credentials}
//! listen = "0.0.0.0:7300"              # the swarm listener the agents dial
//! advertise = "10.0.0.1:7300"          # what agents dial (reachable from the VPC)
//! agent = "/usr/local/bin/provision-agent"   # the agent's path in the image
//!
//! [[group]]
//! id = "trainer"
//! count = 4
//! provider = "ec2"
//! ec2 = { instance_type = "g5.xlarge", image = "ami-0123456789abcdef0", subnet = "subnet-1", security_groups = ["sg-1"], spot = true }
//! ```
//!
//! A group's `ec2` table travels in the node template as `ec2.*` labels
//! ([`GroupShape::to_labels`]), so it is part of what an attempt was made
//! with.
//!
//! # Not yet done
//! - HTTPS: the client speaks plain HTTP (EC2-compatible endpoints, the
//!   testbed); AWS's endpoints need the TLS client of the transport-security
//!   work.
//! - Fetching the agent from the controller by content hash: the image must
//!   hold it at [`Ec2AgentConfig::program`].
//! - A preemption is reported as [`LossCause::LeaseGone`](provisioning::observe::LossCause)
//!   with the reason kept by the plugin ([`Ec2Plugin::loss_reason`]); the
//!   seam has no reason field for a loss yet.

mod client;
mod config;
mod credentials;
mod error;
mod plugin;
mod response;
mod sigv4;
pub mod userdata;

pub use client::{ApiEndpoint, Ec2Client, Filter, PAGES_MAX, RunRequest};
pub use config::{
    AddressChoice, EXTRA_TAGS_MAX, Ec2Settings, GroupShape, LABEL_PREFIX, RESERVED_TAG_PREFIX,
    ROOT_VOLUME_GIB_MAX, ShapeError,
};
pub use credentials::{AwsIdentity, Credentials, CredentialsError, resolve, resolve_with};
pub use error::{Ec2Error, Ec2ErrorKind, ReasonClass};
pub use plugin::{
    DEFAULT_ADOPT_WAIT, DEFAULT_AGENT_PATH, DEFAULT_JOIN_TIMEOUT, DEFAULT_REQUEST_TIMEOUT,
    Ec2AgentConfig, Ec2Plugin, Ec2PluginConfig, Ec2StartError, LossReason, MANAGED_BY,
    PROVIDER_KIND, SPOT_TERMINATION_REASON, TAG_ATTEMPT, TAG_MANAGED_BY, TAG_NODE, TAG_RUN,
    WatchHandle, client_token,
};
pub use response::{Instance, InstanceState, StateChange};
