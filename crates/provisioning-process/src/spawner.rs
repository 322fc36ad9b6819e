//! A dedicated thread that starts every node agent.
//!
//! Linux sends the parent-death signal when the *thread* that forked a
//! child exits, not when its process does. Agents are therefore never
//! spawned from a caller's thread — which could be a short-lived blocking
//! pool thread — but from this thread, which lives exactly as long as the
//! plugin. When the plugin is dropped the thread ends, and every agent it
//! started receives its parent-death signal as a last line of defence.

use std::io;
use std::sync::mpsc;

use tokio::process::Child;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// How many spawn requests may wait for the thread at once.
const SPAWN_QUEUE_MAX: usize = 64;

struct SpawnRequest {
    command: std::process::Command,
    reply: oneshot::Sender<io::Result<UnclaimedChild>>,
}

/// A freshly spawned agent on its way to the caller. Until the caller claims
/// it, dropping it kills the agent: a caller that gave up (its future was
/// dropped) after the reply was sent must not leave an untracked process.
struct UnclaimedChild(Option<Child>);

impl UnclaimedChild {
    fn claim(mut self) -> Option<Child> {
        self.0.take()
    }
}

impl Drop for UnclaimedChild {
    fn drop(&mut self) {
        if let Some(orphan) = self.0.as_mut() {
            tracing::warn!(pid = ?orphan.id(), "killing an agent nobody waits for");
            let _ = orphan.start_kill();
        }
    }
}

/// The handle to the spawner thread. Dropping it ends the thread.
pub(crate) struct Spawner {
    requests: mpsc::SyncSender<SpawnRequest>,
}

impl Spawner {
    /// Starts the thread; children are registered with `runtime`'s process driver.
    pub(crate) fn start(runtime: Handle) -> io::Result<Spawner> {
        let (requests, queue) = mpsc::sync_channel::<SpawnRequest>(SPAWN_QUEUE_MAX);
        std::thread::Builder::new()
            .name("provision-spawner".to_owned())
            .spawn(move || {
                let _runtime = runtime.enter();
                // Ends when every sender is gone, that is when the plugin is dropped.
                for request in queue {
                    let mut command = tokio::process::Command::from(request.command);
                    command.kill_on_drop(false);
                    // When the caller already gave up, the reply comes back and
                    // is dropped here, which kills the agent.
                    let _ = request
                        .reply
                        .send(command.spawn().map(|child| UnclaimedChild(Some(child))));
                }
            })?;
        Ok(Spawner { requests })
    }

    /// Spawns `command` on the spawner thread.
    ///
    /// # Errors
    /// The spawn error, or [`io::ErrorKind::WouldBlock`] when the queue is
    /// full and [`io::ErrorKind::BrokenPipe`] when the thread is gone; in
    /// every error case nothing was started.
    pub(crate) async fn spawn(&self, command: std::process::Command) -> io::Result<Child> {
        let (reply, answer) = oneshot::channel();
        self.requests
            .try_send(SpawnRequest { command, reply })
            .map_err(|error| match error {
                mpsc::TrySendError::Full(_) => io::Error::new(
                    io::ErrorKind::WouldBlock,
                    "too many agents starting at once",
                ),
                mpsc::TrySendError::Disconnected(_) => {
                    io::Error::new(io::ErrorKind::BrokenPipe, "the spawner thread is gone")
                }
            })?;
        let spawned = answer.await.map_err(|_| {
            io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the spawner thread stopped before answering",
            )
        })??;
        spawned
            .claim()
            .ok_or_else(|| io::Error::other("the spawned agent was already claimed"))
    }
}
