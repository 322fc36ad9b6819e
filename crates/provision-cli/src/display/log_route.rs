//! Where log lines go: standard error, past the live block when one is
//! drawn.
//!
//! The live block redraws itself by moving the cursor up over the lines it
//! drew last. A log line written straight to the terminal in between would
//! shift those lines down, and the next redraw would leave a stale copy of
//! the block above the new one. So while a block is drawn, each log line is
//! written with the block wiped first and redrawn after, through the
//! progress library's own `suspend`.

use std::io::Write;
use std::sync::{Mutex, PoisonError};

use indicatif::MultiProgress;
use tracing_subscriber::fmt::MakeWriter;

/// The bars log lines must go past, while a live block is drawn.
static LIVE_BARS: Mutex<Option<MultiProgress>> = Mutex::new(None);

/// From now on, log lines are written past `bars`.
pub(super) fn route_past(bars: &MultiProgress) {
    *LIVE_BARS.lock().unwrap_or_else(PoisonError::into_inner) = Some(bars.clone());
}

/// From now on, log lines go straight to standard error again.
pub(super) fn route_straight() {
    *LIVE_BARS.lock().unwrap_or_else(PoisonError::into_inner) = None;
}

/// The writer of the log subscriber: standard error, past the live block
/// while one is drawn.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LogOutput;

impl<'a> MakeWriter<'a> for LogOutput {
    type Writer = LogLine;

    fn make_writer(&'a self) -> LogLine {
        LogLine(Vec::new())
    }
}

/// One log event's text, gathered and written as a whole when dropped (the
/// subscriber makes one writer per event).
#[derive(Debug)]
pub(crate) struct LogLine(Vec<u8>);

impl Write for LogLine {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        // The lock is let go before writing: the bars have a lock of
        // their own, and a slow terminal must not hold up `route_straight`.
        let bars = LIVE_BARS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        // Write errors are ignored: a closed standard error must not stop
        // the cluster.
        let write = || {
            let mut err = std::io::stderr().lock();
            let _ = err.write_all(&self.0);
            let _ = err.flush();
        };
        match bars {
            Some(bars) => bars.suspend(write),
            None => write(),
        }
    }
}
