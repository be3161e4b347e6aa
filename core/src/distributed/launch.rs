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
//!
//! On a host without GPUs, `ft launch`'s `ft` commands and the ranks `ft
//! train` and `ft eval` start for themselves are forked (`Work::Fork`)
//! rather than `ft` started again: a new process
//! spends ~0.5 s of CPU registering libtorch's operators before it reads its
//! first argument, most of a short CPU run's start, and a copy of this one
//! has done that. A fork is taken only while it is safe: this process runs
//! one thread and has not loaded the CUDA driver. GPU ranks, whose start is
//! CUDA's and NCCL's, are new processes.

use crate::progress::{self, Update};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget};
use std::io::{BufRead, BufReader, PipeReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use crate::signals::{self, SAVED_AND_STOPPED};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
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

/// One running worker: its process (led its own process group) and, once
/// it ended, how.
struct Worker {
    rank: usize,
    pid: i32,
    status: Option<ExitStatus>,
}

impl Worker {
    /// How the worker ended, once it has (reaped here, whether forked or spawned).
    fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            let mut status = 0;
            // SAFETY: waitpid(2) on our own child, without blocking.
            match unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) } {
                0 => {}
                -1 => return Err(std::io::Error::last_os_error()).context(format!("cannot wait for rank {}", self.rank)),
                _ => self.status = Some(ExitStatus::from_raw(status)),
            }
        }
        Ok(self.status)
    }
}

/// Signals each worker's whole process group, so that programs a worker
/// started (and which hold its output pipes) stop with it.
fn signal_all(workers: &mut [Worker], signal: i32) {
    for worker in workers.iter() {
        // SAFETY: kill(2) on a process group our own child made (its members outlive a reaped leader).
        unsafe { libc::kill(-worker.pid, signal) };
    }
}

/// Passes `signal` on to each worker still running (the worker alone: it
/// decides what its own children do while it saves).
fn pass_on(workers: &mut [Worker], signal: i32) {
    for worker in workers.iter_mut() {
        if matches!(worker.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on our own running child.
            unsafe { libc::kill(worker.pid, signal) };
        }
    }
}

/// What each local worker runs.
pub enum Work<'a> {
    /// `program arguments…` in a new process: `ft launch --exec`'s program.
    Exec { program: PathBuf, arguments: Vec<String> },
    /// `run` in a copy of this process, which then exits with its code; where
    /// workers are not forked (`forks_workers`), `ft arguments…` in a new process.
    Fork { run: &'a dyn Fn() -> Result<i32>, arguments: Vec<String> },
}

/// Whether workers are forked (the module's note): no GPU on this host,
/// and a copy of this process may go on running Rust and libtorch — a fork
/// copies only the calling thread (locks other threads held stay held),
/// and a CUDA context does not survive one.
fn forks_workers() -> bool {
    let one_thread = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| s.lines().any(|l| l.split_whitespace().eq(["Threads:", "1"])));
    let cuda_driver = std::fs::read_to_string("/proc/self/maps").map_or(true, |maps| maps.contains("libcuda.so"));
    !ft_sys::cuda::host_has_gpus() && one_thread && !cuda_driver
}

/// Makes this process its worker's: the leader of its own process group
/// (stopped as one), killed when the launcher dies (so a killed launcher
/// never leaves ranks waiting on a dead job), and taking the stopping
/// signals the launcher passes on as a program does by default: a launcher
/// that a script started in the background (`&`) inherited SIGINT ignored,
/// and so would its workers, which then ran on through a second signal
/// until killed. What a spawned worker does before exec, and a forked one
/// first.
fn become_worker() -> std::io::Result<()> {
    // SAFETY: setpgid, prctl and signal are async-signal-safe calls on this process.
    unsafe {
        libc::setpgid(0, 0);
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        for signal in signals::STOPPING {
            libc::signal(signal, libc::SIG_DFL);
        }
    }
    Ok(())
}

/// A worker's environment: variables set, or (`None`) removed.
type Env<'a> = [(&'a str, Option<String>)];

/// Starts one worker with `env`; returns it and its stdout and stderr.
fn start(work: &Work, rank: usize, env: &Env, fork: bool) -> Result<(Worker, PipeReader, PipeReader)> {
    let (stdout, stdout_writer) = std::io::pipe()?;
    let (stderr, stderr_writer) = std::io::pipe()?;
    let pid = match work {
        Work::Fork { run, .. } if fork => {
            let _ = std::io::stdout().flush();
            let _ = std::io::stderr().flush();
            // SAFETY: this process runs one thread (`forks_workers`), so the child's copy of
            // it holds no lock another thread held; the child never returns from this block.
            match unsafe { libc::fork() } {
                -1 => return Err(std::io::Error::last_os_error()).context("cannot fork a worker"),
                0 => {
                    let stdin = std::fs::File::open("/dev/null");
                    // SAFETY: dup2 onto this process's own standard descriptors.
                    let redirected = stdin.map(|stdin| unsafe {
                        libc::dup2(stdin.as_raw_fd(), 0) >= 0 && libc::dup2(stdout_writer.as_raw_fd(), 1) >= 0 && libc::dup2(stderr_writer.as_raw_fd(), 2) >= 0
                    });
                    drop((stdout, stderr, stdout_writer, stderr_writer));
                    let code = if redirected.unwrap_or(false) && become_worker().is_ok() {
                        for (name, value) in env {
                            match value {
                                Some(value) => std::env::set_var(name, value),
                                None => std::env::remove_var(name),
                            }
                        }
                        crate::panic::run_command(&std::env::args_os().collect::<Vec<_>>(), run)
                    } else {
                        1
                    };
                    crate::setup::exit_without_teardown(code)
                }
                pid => pid,
            }
        }
        Work::Fork { arguments, .. } => spawn(&std::env::current_exe().context("cannot find the ft executable")?, arguments, env, stdout_writer, stderr_writer)?,
        Work::Exec { program, arguments } => spawn(program, arguments, env, stdout_writer, stderr_writer)?,
    };
    Ok((Worker { rank, pid, status: None }, stdout, stderr))
}

/// `program arguments…` as a new process with `env` added.
fn spawn(program: &std::path::Path, arguments: &[String], env: &Env, stdout: std::io::PipeWriter, stderr: std::io::PipeWriter) -> Result<i32> {
    let mut command = Command::new(program);
    command.args(arguments).stdin(Stdio::null()).stdout(stdout).stderr(stderr);
    for (name, value) in env {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    // SAFETY: become_worker makes only async-signal-safe calls.
    unsafe { command.pre_exec(become_worker) };
    // Reaped by `Worker::try_wait`: std's handle is not needed past the spawn.
    let child = command.spawn().with_context(|| format!("cannot start {}", program.display()))?;
    Ok(child.id() as i32)
}

/// How long workers get by default to save and exit after a stopping signal.
pub const DEFAULT_SAVE_GRACE_SECS: u64 = 300;

/// Starts `nproc` local workers for a command that was not started by a
/// launcher (what `ft train` and `ft eval` do): each runs `work`.
pub fn spawn_local(nproc: usize, work: Work) -> Result<i32> {
    let options = LaunchOptions {
        nproc_per_node: nproc,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        grace_secs: 5,
        save_grace_secs: DEFAULT_SAVE_GRACE_SECS,
        exec: false,
        command: vec![],
    };
    launch(&options, work)
}

/// `ft launch`: the workers run `options.command`, a program (`exec`) or an
/// `ft` command line, which `run_ft` runs in a forked worker (`Work::Fork`).
pub fn run(options: LaunchOptions, run_ft: &dyn Fn(&[String]) -> Result<i32>) -> Result<i32> {
    if options.exec {
        let work = Work::Exec { program: PathBuf::from(&options.command[0]), arguments: options.command[1..].to_vec() };
        return launch(&options, work);
    }
    let run = || run_ft(&options.command);
    launch(&options, Work::Fork { run: &run, arguments: options.command.clone() })
}

fn launch(args: &LaunchOptions, work: Work) -> Result<i32> {
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
    let console = Console::new();
    // Decided once, before any worker: the forwarding threads below make this process unsafe to fork.
    let fork = matches!(work, Work::Fork { .. }) && forks_workers();
    let mut children = vec![];
    let mut outputs = vec![];
    for local_rank in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local_rank;
        let env = [
            ("RANK", Some(rank.to_string())),
            ("LOCAL_RANK", Some(local_rank.to_string())),
            ("WORLD_SIZE", Some(world_size.to_string())),
            ("LOCAL_WORLD_SIZE", Some(args.nproc_per_node.to_string())),
            ("GROUP_RANK", Some(args.node_rank.to_string())),
            ("MASTER_ADDR", Some(args.master_addr.clone())),
            ("MASTER_PORT", Some(master_port.to_string())),
            (progress::LAUNCHER_DRAWS, console.draws_progress.then(|| "1".into())),
        ];
        let (worker, stdout, stderr) = start(&work, rank, &env, fork)?;
        outputs.push((rank, stdout, stderr));
        children.push(worker);
    }
    // After the forks: a copy of this process made while it had a signal
    // handler would pass the signals its rank gets to this launcher.
    let mut received = signal_hook::iterator::Signals::new(signals::STOPPING)?;
    let forwarders: Vec<_> = outputs
        .into_iter()
        .flat_map(|(rank, stdout, stderr)| [forward(rank, stdout, false, console.clone()), forward(rank, stderr, true, console.clone())])
        .collect();

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
        for worker in children.iter_mut() {
            let rank = worker.rank;
            match worker.try_wait()? {
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
