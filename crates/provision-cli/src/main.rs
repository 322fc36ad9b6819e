//! The `provision` command (work in progress).

fn main() -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
