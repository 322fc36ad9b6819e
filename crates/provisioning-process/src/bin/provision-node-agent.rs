//! The node agent of the local process provider, as a binary of its own.
//!
//! The process plugin starts it; it takes no arguments. The `provision`
//! command offers the same agent as `provision agent`.

fn main() -> std::process::ExitCode {
    provisioning_process::agent::main(std::env::args_os().skip(1).collect())
}
