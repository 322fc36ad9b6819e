//! The node agent as the slurm provider starts it inside a job step (the
//! remote boot mode of [`provisioning_process::agent`]; see
//! [`provisioning_process::agent::remote`]).

fn main() -> std::process::ExitCode {
    provisioning_process::agent::main(std::env::args_os().skip(1).collect())
}
