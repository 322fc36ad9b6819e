//! The node agent, as started on a host by the ssh provider (the remote boot
//! mode of [`provisioning_process::agent`]; see
//! [`provisioning_process::agent::remote`]).

fn main() -> std::process::ExitCode {
    provisioning_process::agent::main(std::env::args_os().skip(1).collect())
}
