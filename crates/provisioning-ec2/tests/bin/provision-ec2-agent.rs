//! The node agent under a name of this package, for its tests only
//! (`CARGO_BIN_EXE_provision-ec2-agent`); what ships is
//! `provisioning-agent`'s `provision-agent`, which runs the same code.

fn main() -> std::process::ExitCode {
    provisioning_agent::main(std::env::args_os().skip(1).collect())
}
