//! The live display of `provision up` in a real terminal: the binary runs in
//! a tmux pane of a tmux server of the test's own (its own socket and
//! configuration), keys are sent as a user types them, and the screen is
//! read back as the terminal shows it, scrollback included. A drop guard
//! kills the server, `up` and every process of the run, passing or failing.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use provisioning::RunId;
use provisioning_agent::os;

/// The binary under test.
const BINARY: &str = env!("CARGO_BIN_EXE_provision");

/// The terminal's size: what a user's window could be.
const COLUMNS: u32 = 120;
const ROWS: u32 = 40;

/// How often the waits look at the screen.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// The bound on a bring-up (10,000 groups in a debug build on a busy
/// machine included).
const BRING_UP_BOUND: Duration = Duration::from_secs(120);
/// The bound on `up` reacting to an interrupt: the teardown shown after the
/// first, the exit after the second.
const INTERRUPT_BOUND: Duration = Duration::from_secs(5);
/// The most threads a terminal `up` may run, whatever its number of groups
/// (it runs a handful; one progress ticker per group made it thousands).
const THREADS_MAX: u64 = 64;
/// How long leftovers get to die in the drop guard.
const CLEANUP_BOUND: Duration = Duration::from_secs(10);

/// `provision up` in a tmux pane, with its own shape file, sockets and
/// state. Dropping it ends the tmux server, `up` and the run's processes.
struct Terminal {
    dir: tempfile::TempDir,
    run: String,
    /// `up`'s process id, once started.
    pid: Option<i32>,
}

impl Terminal {
    fn new(test: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("provision-terminal-")
            .tempdir()
            .expect("a temporary directory");
        // Nothing of the user's tmux configuration applies; a pane stays
        // on screen after `up` exits, so its last lines can be read.
        fs::write(
            dir.path().join("tmux.conf"),
            "set -g remain-on-exit on\nset -g history-limit 50000\n",
        )
        .expect("write the tmux configuration");
        Terminal {
            dir,
            run: format!("term-{test}-{}", std::process::id()),
            pid: None,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn tmux(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .arg("-S")
            .arg(self.path("tmux.sock"))
            .arg("-f")
            .arg(self.path("tmux.conf"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run tmux (scripts/test-deps.sh installs it)")
    }

    /// Writes the shape file and starts `up` on it (with global `args`).
    fn start(&mut self, shape: &str, args: &[&str]) {
        fs::write(self.path("shape.toml"), shape).expect("write the shape file");
        let mut command = format!(
            "exec env -u RUST_LOG -u NO_COLOR -u PROVISION_SOCKET {} --state-dir {} --socket-dir {}",
            quoted(Path::new(BINARY)),
            quoted(&self.path("state")),
            quoted(&self.path("sockets")),
        );
        for arg in args {
            let _ = write!(command, " {arg}");
        }
        let _ = write!(
            command,
            " up --shutdown-timeout 60 {}",
            quoted(&self.path("shape.toml"))
        );
        let columns = COLUMNS.to_string();
        let rows = ROWS.to_string();
        let started = self.tmux(&[
            "new-session",
            "-d",
            "-s",
            "up",
            "-x",
            &columns,
            "-y",
            &rows,
            &command,
        ]);
        assert!(
            started.status.success(),
            "tmux new-session: {}",
            String::from_utf8_lossy(&started.stderr)
        );
        let pid = self.pane("#{pane_pid}");
        self.pid = Some(pid.parse().expect("the pane's process id"));
    }

    /// A tmux format of the pane, such as `#{pane_dead}`.
    fn pane(&self, format: &str) -> String {
        let output = self.tmux(&["display-message", "-p", "-t", "up", format]);
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// The terminal's lines, from the top of its scrollback down, with
    /// trailing blank lines dropped.
    fn screen(&self) -> String {
        let output = self.tmux(&["capture-pane", "-p", "-t", "up", "-S", "-"]);
        let text = String::from_utf8_lossy(&output.stdout);
        text.trim_end().to_owned()
    }

    /// Whether `up` has exited.
    fn exited(&self) -> bool {
        self.pane("#{pane_dead}") == "1"
    }

    /// Waits until the screen satisfies `done`; fails with the screen past
    /// `bound` or when `up` exits first.
    fn wait_screen(&self, what: &str, bound: Duration, done: impl Fn(&str) -> bool) -> Duration {
        let start = Instant::now();
        loop {
            let screen = self.screen();
            if done(&screen) {
                return start.elapsed();
            }
            assert!(
                !self.exited(),
                "up exited while waiting for {what}:\n{screen}"
            );
            assert!(
                start.elapsed() < bound,
                "no {what} within {bound:?}:\n{screen}"
            );
            sleep(POLL_INTERVAL);
        }
    }

    /// Types Ctrl-C.
    fn interrupt(&self) {
        let sent = self.tmux(&["send-keys", "-t", "up", "C-c"]);
        assert!(sent.status.success(), "tmux send-keys");
    }

    /// A line of `/proc/PID/status` of `up`, such as `Threads`.
    fn proc_status(&self, key: &str) -> u64 {
        let pid = self.pid.expect("up was started");
        let status = fs::read_to_string(format!("/proc/{pid}/status")).expect("up runs");
        status
            .lines()
            .find_map(|line| line.strip_prefix(&format!("{key}:")))
            .and_then(|value| value.split_whitespace().next())
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
    }

    fn run_id(&self) -> RunId {
        RunId::new(self.run.as_str())
    }

    /// The agents of the run's nodes (their process group leaders).
    fn agents(&self) -> Vec<os::TaggedProcess> {
        os::run_processes(&self.run_id())
            .expect("read /proc")
            .into_iter()
            .filter(|p| p.is_group_leader())
            .collect()
    }

    /// The lines of the screen that are a live block's header.
    fn headers(&self, screen: &str) -> usize {
        let header = format!("run {} · ", self.run);
        screen
            .lines()
            .filter(|line| line.contains(&header) && !line.contains(':'))
            .count()
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        if let Some(pid) = self.pid {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        let _ = self.tmux(&["kill-server"]);
        let _ = os::kill_run(&self.run_id(), CLEANUP_BOUND);
    }
}

/// `path` quoted for the shell tmux runs the command with.
fn quoted(path: &Path) -> String {
    format!("'{}'", path.display().to_string().replace('\'', "'\\''"))
}

/// A group of `count` nodes whose workload sleeps.
fn sleeping_group(id: &str, count: u32) -> String {
    format!(
        "\n[[group]]\nid = \"{id}\"\ncount = {count}\n[group.boot]\nverify_commands = [\"true\"]\nstart_command = \"sleep 3600\"\n"
    )
}

#[test]
fn a_terminal_up_of_ten_thousand_groups_runs_few_threads_and_stops_on_a_second_interrupt() {
    const GROUPS: usize = 10_000;
    let mut terminal = Terminal::new("many");
    let mut shape = format!("run = \"{}\"\n", terminal.run);
    shape.push_str(&sleeping_group("slow", 2));
    for i in 0..GROUPS {
        let _ = write!(shape, "\n[[group]]\nid = \"g{i}\"\ncount = 0\n");
    }
    terminal.start(&shape, &[]);
    let header = format!(
        "run {} · generation 1 · converged · 2/2 ready",
        terminal.run
    );
    let took = terminal.wait_screen("a converged block", BRING_UP_BOUND, |s| s.contains(&header));
    eprintln!("converged after {took:?}");

    // A few redraws later, the thread count has had time to grow.
    sleep(Duration::from_secs(1));
    let threads = terminal.proc_status("Threads");
    let rss_kb = terminal.proc_status("VmRSS");
    eprintln!("up runs {threads} threads, {rss_kb} kB resident");
    assert!(
        threads <= THREADS_MAX,
        "up runs {threads} threads for {GROUPS} groups (at most {THREADS_MAX})"
    );

    // The block lists the groups in the file's order, 20 of them, and
    // sums up the rest in one line.
    let screen = terminal.screen();
    let listed: Vec<&str> = screen
        .lines()
        .filter(|line| line.contains(" ready") && line.contains('['))
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    let expected: Vec<String> = std::iter::once("slow".to_owned())
        .chain((0..19).map(|i| format!("g{i}")))
        .collect();
    assert_eq!(listed, expected, "{screen}");
    assert!(
        screen.contains("and 9,981 more groups: 0/0 ready"),
        "{screen}"
    );

    // Stopped agents cannot stop their nodes: the teardown stays under way
    // until it is forced.
    let agents = terminal.agents();
    assert_eq!(agents.len(), 2, "the agents of slow-0 and slow-1");
    for agent in &agents {
        kill(Pid::from_raw(agent.pid), Signal::SIGSTOP).expect("stop an agent");
    }

    terminal.interrupt();
    let took = terminal.wait_screen("the teardown", INTERRUPT_BOUND, |s| {
        s.contains("tearing the cluster down")
    });
    eprintln!("the teardown started {took:?} after the first interrupt");

    terminal.interrupt();
    let start = Instant::now();
    while !terminal.exited() {
        assert!(
            start.elapsed() < INTERRUPT_BOUND,
            "up still runs {INTERRUPT_BOUND:?} after the second interrupt:\n{}",
            terminal.screen()
        );
        sleep(POLL_INTERVAL);
    }
    eprintln!("up exited {:?} after the second interrupt", start.elapsed());
    let screen = terminal.screen();
    assert!(screen.contains("forcing shutdown"), "{screen}");
    assert!(screen.contains("shutdown was forced"), "{screen}");
}

#[test]
fn a_log_line_printed_under_the_live_block_leaves_no_stale_copy_of_it() {
    let mut terminal = Terminal::new("log");
    let mut shape = format!("run = \"{}\"\n", terminal.run);
    shape.push_str(&sleeping_group("web", 2));
    shape.push_str(&sleeping_group("worker", 2));
    // `-v`: info lines too, printed while the block is drawn.
    terminal.start(&shape, &["-v"]);
    let converged = format!(
        "run {} · generation 1 · converged · 4/4 ready",
        terminal.run
    );
    terminal.wait_screen("a converged block", BRING_UP_BOUND, |s| {
        s.contains(&converged)
    });

    let victim = terminal
        .agents()
        .into_iter()
        .find(|p| p.node.as_deref() == Some("web-0"))
        .expect("the agent of web-0 runs");
    kill(Pid::from_raw(victim.pid), Signal::SIGKILL).expect("kill the agent of web-0");
    terminal.wait_screen("web-0's replacement, converged", BRING_UP_BOUND, |s| {
        s.contains("node web-0 replaced")
            && s.lines().last().is_some_and(|l| l.contains("worker"))
            && s.contains(&converged)
    });
    // A few more ticks of the spinner over the new lines.
    sleep(Duration::from_secs(1));

    let screen = terminal.screen();
    let logs = screen
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" INFO "))
        .count();
    assert!(logs > 0, "log lines were printed:\n{screen}");
    assert_eq!(terminal.headers(&screen), 1, "one block:\n{screen}");
    for group in ["web", "worker"] {
        let lines = screen
            .lines()
            .filter(|l| l.split_whitespace().next() == Some(group) && l.contains(" ready"))
            .count();
        assert_eq!(lines, 1, "one line of group {group}:\n{screen}");
    }
    // The block is the last thing on screen, under every log line.
    let lines: Vec<&str> = screen.lines().collect();
    let last_log = lines
        .iter()
        .rposition(|l| l.contains(" WARN ") || l.contains(" INFO "))
        .unwrap_or(0);
    let header = lines
        .iter()
        .position(|l| l.contains(&converged))
        .unwrap_or(0);
    assert!(last_log < header, "log lines go above the block:\n{screen}");
}

#[test]
fn ctrl_c_under_the_live_block_leaves_no_stale_copy_of_its_header() {
    let mut terminal = Terminal::new("interrupt");
    let mut shape = format!("run = \"{}\"\n", terminal.run);
    shape.push_str(&sleeping_group("web", 2));
    terminal.start(&shape, &[]);
    let converged = format!(
        "run {} · generation 1 · converged · 2/2 ready",
        terminal.run
    );
    terminal.wait_screen("a converged block", BRING_UP_BOUND, |s| {
        s.contains(&converged)
    });
    // The terminal echoes typed control keys by default (`^C`); the block
    // must not be drawn over by the echo.
    terminal.interrupt();
    let start = Instant::now();
    while !terminal.exited() {
        assert!(
            start.elapsed() < BRING_UP_BOUND,
            "up still runs after Ctrl-C:\n{}",
            terminal.screen()
        );
        sleep(POLL_INTERVAL);
    }
    let screen = terminal.screen();
    assert!(screen.contains("bye"), "a clean teardown:\n{screen}");
    assert_eq!(
        terminal.headers(&screen),
        0,
        "the block is gone, with no stale header left behind:\n{screen}"
    );
    assert!(
        !screen.contains("^C"),
        "no echoed ^C in the output:\n{screen}"
    );
}
