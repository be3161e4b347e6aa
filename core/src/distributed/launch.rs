//! What torchrun does for one node (`ft launch`, and `ft train` starting
//! its own local ranks): starts `nproc_per_node` workers with torchrun's
//! environment, prefixes their output with the rank (and, on a terminal,
//! draws rank 0's progress bar from the lines it writes for it:
//! `crate::progress`), and when one fails stops the others and exits with
//! its code. A stopping signal (SIGINT, SIGTERM, SIGUSR1, …:
//! `signals::STOPPING`) is passed on to the workers, which save a checkpoint
//! and exit with `signals::SAVED_AND_STOPPED`, given `save_grace_secs` to do
//! so; a second signal stops them at once. The launcher's own exit code
//! tells a scheduler which of these happened (`exit_code`).

use crate::progress::{self, Update};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use crate::signals::{self, SAVED_AND_STOPPED};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// One node's part of a job, as torchrun's flags describe it.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// Worker processes on this node (one per GPU for NCCL).
    pub nproc_per_node: usize,
    /// Nodes in the job; run `ft launch` once on each.
    pub nnodes: usize,
    /// This node's index, 0..nnodes.
    pub node_rank: usize,
    /// Address of node 0, where rank 0 hosts the rendezvous store.
    pub master_addr: String,
    /// Port of the rendezvous store (default: a free port on one node, 29500 on several).
    pub master_port: Option<u16>,
    /// Seconds a worker gets to exit after the others are told to stop.
    pub grace_secs: u64,
    /// Seconds the workers get to save a checkpoint and exit after a stopping signal.
    pub save_grace_secs: u64,
    /// Run an arbitrary program instead of an `ft` subcommand (like torchrun --no-python).
    pub exec: bool,
    /// The `ft` subcommand (or, with --exec, the program) and its arguments.
    pub command: Vec<String>,
}

fn describe(status: ExitStatus) -> (String, i32) {
    match (status.code(), status.signal()) {
        (Some(code), _) => (format!("exited with code {code}"), code),
        (None, Some(signal)) => (format!("was killed by signal {signal}"), 128 + signal),
        _ => ("ended".into(), 1),
    }
}

/// Where the workers' output goes: their lines, and rank 0's progress as a
/// bar on this process's stderr when that is a terminal (the workers' is a
/// pipe, so they cannot draw one).
#[derive(Clone)]
struct Console {
    draws_progress: bool,
    /// Hidden until the first update, so that nothing shows before training.
    bar: ProgressBar,
}

impl Console {
    fn new() -> Console {
        let bar = progress::bar(0, ProgressDrawTarget::hidden());
        Console { draws_progress: std::io::IsTerminal::is_terminal(&std::io::stderr()), bar }
    }

    /// A worker's line, prefixed with its rank, printed above the bar.
    fn line(&self, rank: usize, text: &str, to_stderr: bool) {
        self.bar.suspend(|| {
            let _ = if to_stderr {
                writeln!(std::io::stderr().lock(), "[rank {rank}] {text}")
            } else {
                writeln!(std::io::stdout().lock(), "[rank {rank}] {text}")
            };
        });
    }

    /// The launcher's own message, printed above the bar.
    fn say(&self, text: &str) {
        self.bar.suspend(|| {
            let _ = writeln!(std::io::stderr().lock(), "ft launch: {text}");
        });
    }

    /// Rank 0's progress (never printed as a line: without a terminal no worker sends any).
    fn progress(&self, update: Update) {
        if !self.draws_progress || self.bar.is_finished() {
            return;
        }
        if update.done {
            return self.bar.finish_and_clear();
        }
        let first = self.bar.is_hidden();
        if first {
            self.bar.reset_elapsed();
        }
        self.bar.set_length(update.total);
        self.bar.set_position(update.step);
        self.bar.set_message(update.message);
        if first {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    }

    /// The workers are gone: a bar rank 0 did not finish stays as it was.
    fn close(&self) {
        if !self.bar.is_finished() && !self.bar.is_hidden() {
            self.bar.abandon();
        }
    }
}

/// Copies a worker's output line by line, each line prefixed with its rank.
fn forward(rank: usize, source: impl Read + Send + 'static, to_stderr: bool, console: Console) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(source);
        let mut line = Vec::new();
        while matches!(reader.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            let text = String::from_utf8_lossy(&line);
            let text = text.trim_end_matches('\n');
            match Update::decode(text).filter(|_| to_stderr) {
                Some(update) => console.progress(update),
                None => console.line(rank, text, to_stderr),
            }
            line.clear();
        }
    })
}

/// The job's exit code, as a scheduler reads it (README, "Exit codes"): a
/// rank's own failure (its code), else 128 + the signal the ranks were
/// force-stopped with (the user's second signal; SIGTERM or SIGKILL when
/// they did not stop within the grace periods), else 75 when they saved
/// and stopped on a signal, else 0.
fn exit_code(failed: Option<i32>, forced: Option<i32>, saved_and_stopped: bool) -> i32 {
    match (failed, forced) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) if saved_and_stopped => SAVED_AND_STOPPED,
        (None, None) => 0,
    }
}

/// Signals each worker's whole process group, so that programs a worker
/// started (and which hold its output pipes) stop with it.
fn signal_all(children: &mut [(usize, Child)], signal: i32) {
    for (_, child) in children.iter_mut() {
        // SAFETY: kill(2) on a process group led by our own child.
        unsafe { libc::kill(-(child.id() as i32), signal) };
    }
}

/// Passes `signal` on to each worker still running (the worker alone: it
/// decides what its own children do while it saves).
fn pass_on(children: &mut [(usize, Child)], signal: i32) {
    for (_, child) in children.iter_mut() {
        if matches!(child.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on our own running child.
            unsafe { libc::kill(child.id() as i32, signal) };
        }
    }
}

/// How long workers get by default to save and exit after a stopping signal.
pub const DEFAULT_SAVE_GRACE_SECS: u64 = 300;

/// Starts `nproc` local workers running `ft <arguments>` (what `ft train`
/// does when no launcher started it).
pub fn spawn_local(nproc: usize, arguments: Vec<String>) -> Result<i32> {
    run(LaunchOptions {
        nproc_per_node: nproc,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        grace_secs: 5,
        save_grace_secs: DEFAULT_SAVE_GRACE_SECS,
        exec: false,
        command: arguments,
    })
}

pub fn run(args: LaunchOptions) -> Result<i32> {
    if args.nproc_per_node == 0 || args.nnodes == 0 {
        bail!("--nproc-per-node and --nnodes must be at least 1");
    }
    if args.node_rank >= args.nnodes {
        bail!("--node-rank {} must be below --nnodes {}", args.node_rank, args.nnodes);
    }
    let master_port = match args.master_port {
        Some(port) => port,
        None if args.nnodes == 1 => crate::env::free_port()?,
        None => 29500,
    };
    let world_size = args.nproc_per_node * args.nnodes;
    let (program, program_args) = if args.exec {
        (std::path::PathBuf::from(&args.command[0]), &args.command[1..])
    } else {
        (std::env::current_exe().context("cannot find the ft executable")?, &args.command[..])
    };

    let mut received = signal_hook::iterator::Signals::new(signals::STOPPING)?;

    let console = Console::new();
    let mut children = vec![];
    let mut forwarders = vec![];
    for local_rank in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local_rank;
        let mut command = Command::new(&program);
        command
            .args(program_args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", master_port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if console.draws_progress {
            command.env(progress::LAUNCHER_DRAWS, "1");
        } else {
            command.env_remove(progress::LAUNCHER_DRAWS);
        }
        // SAFETY: setpgid and prctl are async-signal-safe. Each worker leads
        // its own process group (stopped as one), and dies with the launcher,
        // so a killed launcher never leaves ranks waiting on a dead job.
        unsafe {
            command.pre_exec(|| {
                libc::setpgid(0, 0);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command.spawn().with_context(|| format!("cannot start {}", program.display()))?;
        forwarders.push(forward(rank, child.stdout.take().expect("piped"), false, console.clone()));
        forwarders.push(forward(rank, child.stderr.take().expect("piped"), true, console.clone()));
        children.push((rank, child));
    }

    // A rank's own failure, the first: its code is the job's.
    let mut failed: Option<i32> = None;
    let mut saved_and_stopped = false;
    // The signal the ranks were force-stopped with, once they were: the user's second one, or the launcher's own.
    let mut forced: Option<i32> = None;
    // Since when the workers are saving and stopping (signalled, or one of them stopped so).
    let mut saving_since: Option<Instant> = None;
    // Since when the workers are told to stop at once (a failure, or a second signal).
    let mut stopping_since: Option<Instant> = None;
    let mut running = children.len();
    while running > 0 {
        for signal in received.pending() {
            let name = signals::name(signal);
            if saving_since.is_none() {
                console.say(&format!("{name}: passed on to the ranks, which save a checkpoint and stop (a second signal stops them at once)"));
                saving_since = Some(Instant::now());
            } else {
                console.say(&format!("{name} again: the ranks stop at once"));
                stopping_since.get_or_insert_with(Instant::now);
                forced.get_or_insert(signal);
            }
            pass_on(&mut children, signal);
        }
        running = 0;
        for (rank, child) in children.iter_mut() {
            match child.try_wait()? {
                None => running += 1,
                // The ranks agreed to stop: each saved its part and exits so.
                Some(status) if status.code() == Some(SAVED_AND_STOPPED) => {
                    saving_since.get_or_insert_with(Instant::now);
                    saved_and_stopped = true;
                }
                Some(status) if !status.success() && stopping_since.is_none() && failed.is_none() => {
                    let (what, code) = describe(status);
                    console.say(&format!("rank {rank} {what}; stopping the other ranks"));
                    failed = Some(code);
                    stopping_since = Some(Instant::now());
                }
                Some(_) => {}
            }
        }
        let save_grace = Duration::from_secs(args.save_grace_secs);
        if saving_since.is_some_and(|since| since.elapsed() > save_grace) && stopping_since.is_none() && running > 0 {
            console.say(&format!("the ranks did not stop within {} s of the signal (--save-grace-secs); stopping them", args.save_grace_secs));
            stopping_since = Some(Instant::now());
        }
        if let Some(since) = stopping_since.filter(|_| running > 0) {
            let grace = Duration::from_secs(args.grace_secs);
            let signal = if since.elapsed() < grace { libc::SIGTERM } else { libc::SIGKILL };
            // A failure stops the others, and its own code says why; a forced stop's code is the signal's.
            if failed.is_none() {
                forced = Some(forced.map_or(signal, |first| if signal == libc::SIGKILL { signal } else { first }));
            }
            signal_all(&mut children, signal);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let exit_code = exit_code(failed, forced, saved_and_stopped);
    for handle in forwarders {
        let _ = handle.join();
    }
    console.close();
    Ok(exit_code)
}
