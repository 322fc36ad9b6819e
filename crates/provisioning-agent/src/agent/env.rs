//! The environment through which the plugin configures an agent, besides
//! the tags in [`crate::os`] ([`RUN_TAG`](crate::os::RUN_TAG),
//! [`NODE_TAG`](crate::os::NODE_TAG), [`ATTEMPT_TAG`](crate::os::ATTEMPT_TAG)).

/// The pid of the controller that started the agent. The agent exits at once
/// if its parent is someone else (the controller died before the agent armed
/// its parent-death signal).
pub const PARENT_PID: &str = "PROVISION_AGENT_PARENT_PID";

/// Set to `1` to start the agent detached from its controller: it starts a
/// session of its own, arms no parent-death signal, does not check its
/// parent, and outlives the loss of its swarm connection, waiting for a
/// restarted controller to hand it a new swarm address (see
/// [`crate::wire::BootOrder::resume_only`]). [`PARENT_PID`] is not used then.
pub const DETACHED: &str = "PROVISION_AGENT_DETACHED";

/// The grace, in milliseconds, between `SIGTERM` and `SIGKILL` when the agent
/// stops its node.
pub const STOP_GRACE_MS: &str = "PROVISION_AGENT_STOP_GRACE_MS";

/// The command that started the agent (program, then arguments; each part
/// hex-encoded, separated by commas). The agent starts its wrapper with it.
pub const COMMAND: &str = "PROVISION_AGENT_COMMAND";

/// A filter for the agent's own log (the `tracing` `EnvFilter` syntax);
/// `info` when unset.
pub const LOG: &str = "PROVISION_AGENT_LOG";

/// Selects the binary's role. Unset means the agent itself.
pub const ROLE: &str = "PROVISION_AGENT_ROLE";

/// The [`ROLE`] value of the wrapper that runs a shell command.
pub(crate) const ROLE_WORKLOAD: &str = "workload";

/// The wrapper's shell command.
pub(crate) const WORKLOAD_COMMAND: &str = "PROVISION_WORKLOAD_COMMAND";

/// The wrapper's positional arguments, as a JSON array of strings.
pub(crate) const WORKLOAD_ARGS: &str = "PROVISION_WORKLOAD_ARGS";

/// The pid of the agent that started the wrapper.
pub(crate) const WORKLOAD_PARENT_PID: &str = "PROVISION_WORKLOAD_PARENT_PID";

/// The user id the wrapper switches to before running its command.
pub(crate) const WORKLOAD_UID: &str = "PROVISION_WORKLOAD_UID";

/// The group id the wrapper switches to before running its command.
pub(crate) const WORKLOAD_GID: &str = "PROVISION_WORKLOAD_GID";

/// Selects the remote boot mode (see [`super::remote`]): the path of a `0600`
/// file holding the JSON boot order, removed once read.
pub const BOOT_FILE: &str = "PROVISION_AGENT_BOOT_FILE";

/// Remote boot mode: an optional file the agent appends its stages to, one
/// JSON [`ControlReply`](crate::wire::ControlReply) a line.
pub const STATUS_FILE: &str = "PROVISION_AGENT_STATUS_FILE";

/// Remote boot mode: how long, in milliseconds, the agent re-dials the swarm
/// after its connection ended before it stops its node (default 60 s).
pub const REJOIN_WINDOW_MS: &str = "PROVISION_AGENT_REJOIN_WINDOW_MS";

/// The loopback address the agent's control listener binds (and so the
/// node's endpoint and `PROVISION_ADDRESS`); `127.0.0.1` when unset. The
/// process provider gives every slot an address of its own, so workloads
/// of several nodes on one machine can each bind the same ports.
pub const LISTEN_ADDRESS: &str = "PROVISION_AGENT_LISTEN_ADDRESS";
