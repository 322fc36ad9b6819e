//! The node agent as a binary of its own: what the process provider starts
//! on this machine and what the SSH and Slurm providers start on theirs.
//! It takes no arguments (see [`provisioning_agent::agent::main`]); the
//! `provision` command offers the same agent as `provision agent`.

fn main() -> std::process::ExitCode {
    provisioning_agent::main(std::env::args_os().skip(1).collect())
}
