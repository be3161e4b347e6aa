//! What a user sees of a failure: an error without libtorch's C++ stack,
//! and a panic, which is a bug in ft, as one line naming the command and
//! asking for a report, not Rust's panic message and libtorch's stack dump;
//! and libtorch's errors inside code that cannot return them (a model's
//! math) as errors where input or memory can cause them.

use anyhow::{bail, Result};
use std::backtrace::{Backtrace, BacktraceStatus};
use std::ffi::OsString;
use std::panic::{catch_unwind, AssertUnwindSafe, PanicHookInfo};
use std::sync::{Mutex, OnceLock};

/// The exit code of a command a panic ended: 70, sysexits' EX_SOFTWARE
/// (an internal software error) — inside 1–100, apart from Rust's own 101
/// for a panic, 1 for an error and 75 for an interrupted run.
pub const EXIT_CODE: i32 = 70;

/// The command the panic report names (`ft train`).
static COMMAND: OnceLock<String> = OnceLock::new();

/// A panic as the hook saw it: "message at file:line", and the backtrace
/// when `RUST_BACKTRACE` asks for one.
struct Panic {
    what: String,
    backtrace: Backtrace,
}

/// The main thread's last panic, for `run_command` to report once it has
/// unwound: one that code catches (`libtorch_errors`) is not reported.
static MAIN_PANIC: Mutex<Option<Panic>> = Mutex::new(None);

/// Runs the command `args` names (the process's arguments, the program's
/// own first), whose work is `run`, and returns its exit code: an error is
/// printed (libtorch's C++ stack in it only when `RUST_BACKTRACE` asks for
/// it) and exits 1; a panic anywhere becomes one line on stderr (with the
/// backtrace when `RUST_BACKTRACE` asks for it), and on the main thread,
/// where the command runs, ends it with [`EXIT_CODE`].
pub fn run_command(args: &[OsString], run: impl FnOnce() -> Result<i32>) -> i32 {
    let _ = COMMAND.set(command_name(args));
    std::panic::set_hook(Box::new(|info| {
        let panic = Panic { what: describe(info), backtrace: Backtrace::capture() };
        match std::thread::current().name() {
            Some("main") => *MAIN_PANIC.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(panic),
            name => report(Panic { what: format!("{} (in thread {})", panic.what, name.unwrap_or("unnamed")), ..panic }),
        }
    }));
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(code)) => code,
        Ok(Err(error)) => {
            let message = format!("{error:#}");
            eprintln!("error: {}", if backtrace_wanted() { message } else { without_libtorch_stack(&message) });
            1
        }
        Err(_) => {
            let panic = MAIN_PANIC.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
            report(panic.unwrap_or(Panic { what: "a panic".into(), backtrace: Backtrace::disabled() }));
            EXIT_CODE
        }
    }
}

/// An error raised from code that returns none (a model's math: a
/// mixture of experts' token exchange), which [`libtorch_errors`] returns
/// as an error.
pub struct Raised(pub String);

/// Raises `error` from code that cannot return it (see [`Raised`]).
pub fn raise(error: anyhow::Error) -> ! {
    std::panic::panic_any(Raised(format!("{error:#}")))
}

/// Runs `body`, a model's math or a tensor operation that input can make
/// fail (ids, sizes, memory), and returns libtorch's error as an error
/// naming `what` where tch, in a method without `f_`, panicked with it
/// (or the error `raise`d); any other panic is a bug and goes on unwinding.
pub fn libtorch_errors<T>(what: &str, body: impl FnOnce() -> T) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => Ok(value),
        Err(payload) if payload.is::<Raised>() => {
            MAIN_PANIC.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
            let Raised(message) = payload.downcast_ref::<Raised>().expect("checked above");
            bail!("{what}: {message}")
        }
        Err(payload) => match payload_text(payload.as_ref()).and_then(libtorch_message) {
            Some(message) => {
                // Handled: not a panic for `run_command` to report.
                MAIN_PANIC.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
                bail!("{what}: libtorch: {message}")
            }
            None => std::panic::resume_unwind(payload),
        },
    }
}

/// The first line of the libtorch error a tch panic carries
/// (`` called `Result::unwrap()` on an `Err` value: Torch("…") ``), without
/// the C++ stack after it; None for any other panic.
fn libtorch_message(panic: &str) -> Option<String> {
    let (_, quoted) = panic.split_once("`Err` value: Torch(\"")?;
    // The error is Debug-formatted: its line breaks are `\n` escapes.
    let first_line = quoted.split("\\n").next().unwrap_or(quoted);
    Some(first_line.trim_end_matches("\")").trim().to_string())
}

fn payload_text(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied())
}

/// "message at file:line", the message cut to one line.
fn describe(info: &PanicHookInfo) -> String {
    let text = payload_text(info.payload()).unwrap_or("no message");
    let message = libtorch_message(text).unwrap_or_else(|| text.lines().next().unwrap_or("").to_string());
    match info.location() {
        Some(location) => format!("{message} at {}:{}", location.file(), location.line()),
        None => message,
    }
}

fn report(panic: Panic) {
    let command = COMMAND.get().map_or("ft", String::as_str);
    eprintln!("{command}: internal error (a bug in ft): {}. Please report it with the command you ran; RUST_BACKTRACE=1 shows the backtrace.", panic.what);
    if panic.backtrace.status() == BacktraceStatus::Captured {
        eprint!("{}", panic.backtrace);
    }
}

fn backtrace_wanted() -> bool {
    std::env::var_os("RUST_BACKTRACE").is_some_and(|value| value != "0")
}

/// `message` without the C++ stack libtorch appends to its errors
/// ("Exception raised from … (most recent call first):" and its frames).
fn without_libtorch_stack(message: &str) -> String {
    let stack = |line: &&str| line.starts_with("Exception raised from ") || line.starts_with("frame #");
    message.lines().filter(|line| !stack(line)).collect::<Vec<_>>().join("\n")
}

/// `ft <command>`: the first argument after the program that is neither
/// a flag nor a global `--plugin`'s value.
fn command_name(args: &[OsString]) -> String {
    let mut words = args.iter().skip(1).map(|arg| arg.to_string_lossy());
    while let Some(word) = words.next() {
        if word == "--plugin" {
            words.next();
        } else if !word.starts_with('-') {
            return format!("ft {word}");
        }
    }
    "ft".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tch_panic_becomes_libtorchs_first_line_and_other_panics_go_on() {
        let panic = r#"called `Result::unwrap()` on an `Err` value: Torch("index out of range in self\nException raised from operator() at /pytorch/aten/src/ATen/native/TensorAdvancedIndexing.cpp:1190 (most recent call first):\nframe #0: c10::Error::Error")"#;
        assert_eq!(libtorch_message(panic).as_deref(), Some("index out of range in self"));
        let error = libtorch_errors("ft forward", || std::panic::panic_any(panic.to_string())).unwrap_err();
        assert_eq!(error.to_string(), "ft forward: libtorch: index out of range in self");
        let other = catch_unwind(|| libtorch_errors("x", || panic!("a bug")));
        assert!(other.is_err(), "a panic that is not libtorch's is not turned into an error");
    }

    #[test]
    fn an_errors_libtorch_stack_is_left_out() {
        let error = "weights: Internal torch error: Found no NVIDIA driver on your system.\nException raised from device_count_impl at CUDAFunctions.cpp:40 (most recent call first):\nframe #0: c10::Error::Error() + 0x9d\nframe #1: f() + 0x69";
        assert_eq!(without_libtorch_stack(error), "weights: Internal torch error: Found no NVIDIA driver on your system.");
        assert_eq!(without_libtorch_stack("a\nb"), "a\nb", "other lines stay");
    }

    #[test]
    fn the_command_is_the_first_word_after_the_global_plugins() {
        let args = |words: &[&str]| words.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(command_name(&args(&["ft", "--plugin", "lib.so", "train", "--model", "m"])), "ft train");
        assert_eq!(command_name(&args(&["ft", "forward", "--ids", "x"])), "ft forward");
        assert_eq!(command_name(&args(&["ft"])), "ft");
    }
}
