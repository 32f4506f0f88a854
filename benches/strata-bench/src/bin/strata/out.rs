//! Checked output: stdout and the files a run writes (`--json`, `--plot`,
//! `--dump`, `trace gen --out`).
//!
//! - A reader that left (EPIPE, e.g. `strata info | head -1`) is not an
//!   error: further stdout is dropped, the run goes on (its output files
//!   are still written) and the exit status is that of the work, 0 on
//!   success, as most Unix tools behave when SIGPIPE is ignored.
//! - Any other failure to write (ENOSPC on `/dev/full`, EIO) is one line,
//!   "writing stdout: No space left on device", and exit status 1: the
//!   input was fine, the output could not be delivered.
//! - Output paths are checked before the run ([`OutputPath::check`]), so a
//!   bad path is exit 2 at once rather than after the measuring.
//! - An output file is written whole or not at all ([`OutputPath::write_with`]):
//!   a write that fails part-way leaves no partial report or trace.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use strata::{Error, ErrorKind};

static STDOUT_GONE: AtomicBool = AtomicBool::new(false);

/// An I/O error's text without Rust's " (os error N)" tail.
pub fn describe(e: &std::io::Error) -> String {
    without_os_error_codes(&e.to_string())
}

/// `text` without the " (os error N)" tails that the library's errors carry
/// from the I/O errors they wrap: the CLI's one line names the error, as
/// [`describe`] does for one I/O error.
pub fn without_os_error_codes(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(" (os error ") {
        let tail = &rest[i + " (os error ".len()..];
        let digits = tail
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(tail.len());
        if digits > 0 && tail[digits..].starts_with(')') {
            out.push_str(&rest[..i]);
            rest = &tail[digits + 1..];
        } else {
            out.push_str(&rest[..i + 1]);
            rest = &rest[i + 1..];
        }
    }
    out.push_str(rest);
    out
}

fn stdout_result(r: std::io::Result<()>) -> Result<(), Error> {
    match r {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            STDOUT_GONE.store(true, Ordering::Relaxed);
            Ok(())
        }
        Err(e) => Err(Error::new(
            ErrorKind::Io,
            format!("writing stdout: {}", describe(&e)),
        )),
    }
}

/// Writes one line to stdout (see the module docs for failures).
pub fn line(args: std::fmt::Arguments<'_>) -> Result<(), Error> {
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    stdout_result(out.write_fmt(args).and_then(|()| out.write_all(b"\n")))
}

/// Prints a configuration's promotions into device memory that paid (the
/// page was accessed there before it left) out of all of them, settled.
pub fn promotions_paid(config: &str, (paid, unpaid): (u64, u64)) -> Result<(), Error> {
    line(format_args!(
        "{config}: {paid} of {} promotions into device memory paid (the page was accessed there before it left)",
        paid + unpaid
    ))
}

/// Flushes stdout at the end of a run.
pub fn flush() -> Result<(), Error> {
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return Ok(());
    }
    stdout_result(std::io::stdout().lock().flush())
}

/// One line on stderr; a closed stderr is ignored (there is nowhere left
/// to say anything).
pub fn warn(args: std::fmt::Arguments<'_>) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| err.write_all(b"\n"));
}

static PENDING: parking_lot::Mutex<Vec<String>> = parking_lot::Mutex::new(Vec::new());

/// A warning held until the work starts ([`flush_warnings`]): a run refused
/// first says only why it was refused, in one line.
pub fn defer_warning(line: String) {
    PENDING.lock().push(line);
}

/// Prints the deferred warnings (once).
pub fn flush_warnings() {
    for line in std::mem::take(&mut *PENDING.lock()) {
        warn(format_args!("{line}"));
    }
}

/// A file a run will write, checked before the run.
#[derive(Debug)]
pub struct OutputPath {
    flag: &'static str,
    path: PathBuf,
}

/// Refuses two of `files` (each a flag and its path, `None` where not
/// given) naming the same file: an output written over an input, or one
/// output over another.
pub fn distinct_files(files: &[(&str, Option<&Path>)]) -> Result<(), Error> {
    // The directory resolved (links, `..`), the name as given.
    let key = |p: &Path| -> PathBuf {
        let dir = p
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        match (dir.canonicalize(), p.file_name()) {
            (Ok(d), Some(name)) => d.join(name),
            _ => p.to_path_buf(),
        }
    };
    let given: Vec<(&str, &Path)> = files
        .iter()
        .filter_map(|(f, p)| p.map(|p| (*f, p)))
        .collect();
    for (i, (fa, pa)) in given.iter().enumerate() {
        for (fb, pb) in &given[i + 1..] {
            if key(pa) == key(pb) {
                return Err(Error::invalid(format!(
                    "{fa} and {fb} name the same file {}: give each its own",
                    pa.display()
                )));
            }
        }
    }
    Ok(())
}

/// Where writing `path` puts the bytes: the path, or a link's target
/// (which need not exist yet).
fn landing(path: &Path) -> PathBuf {
    match std::fs::read_link(path) {
        Ok(t) if t.is_relative() => path.parent().unwrap_or(Path::new("")).join(t),
        Ok(t) => t,
        Err(_) => path.to_path_buf(),
    }
}

/// Fills `file` through a buffer and syncs it.
fn fill_and_sync(
    file: std::fs::File,
    fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut w = std::io::BufWriter::new(file);
    fill(&mut w)?;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_data().or_else(|e| {
        // Character devices and pipes cannot sync; that is no failure.
        if e.raw_os_error() == Some(libc::EINVAL) {
            Ok(())
        } else {
            Err(e)
        }
    })
}

impl OutputPath {
    /// Checks that `path` (given as `flag`) can be written: not a
    /// directory, in an existing directory, and opening it for writing
    /// works. A file that did not exist before is removed again, so a run
    /// refused later leaves nothing behind; an existing one is untouched.
    pub fn check(flag: &'static str, path: &Path) -> Result<Self, Error> {
        let shown = path.display();
        if path.as_os_str().is_empty() {
            return Err(Error::invalid(format!("{flag} is empty; name a file")));
        }
        if path.is_dir() {
            return Err(Error::invalid(format!(
                "{flag} {shown} is a directory; name a file"
            )));
        }
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if !parent.exists() {
            return Err(Error::invalid(format!(
                "{flag} {shown}: directory {} does not exist",
                parent.display()
            )));
        }
        if !parent.is_dir() {
            return Err(Error::invalid(format!(
                "{flag} {shown}: {} is not a directory",
                parent.display()
            )));
        }
        // What opening creates: the path, or a (dangling) link's target.
        let target = landing(path);
        let existed = target.exists();
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!("{flag} {shown}: {}", describe(&e)),
                )
            })?;
        if !existed {
            let _ = std::fs::remove_file(&target);
        }
        Ok(Self {
            flag,
            path: path.to_path_buf(),
        })
    }

    /// `check` for an optional flag.
    pub fn check_opt(flag: &'static str, path: &Option<PathBuf>) -> Result<Option<Self>, Error> {
        path.as_deref().map(|p| Self::check(flag, p)).transpose()
    }

    /// Writes the file: `fill` is given a buffered writer. A failure is
    /// one line naming the file, exit status 1, and leaves no part of the
    /// output: a regular file is written beside its name and renamed over
    /// it once complete, so a new one does not appear and an existing one
    /// (or a link's target) stays as it was. A device or a pipe is
    /// written in place.
    pub fn write_with(
        &self,
        fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<(), Error> {
        let fail = |e: std::io::Error| {
            Error::new(
                ErrorKind::Io,
                format!(
                    "writing {} ({}): {}",
                    self.path.display(),
                    self.flag,
                    describe(&e)
                ),
            )
        };
        let in_place = |fill| {
            let file = std::fs::File::create(&self.path).map_err(fail)?;
            fill_and_sync(file, fill).map_err(fail)
        };
        let target = landing(&self.path);
        let existing = std::fs::metadata(&target).ok();
        if existing.as_ref().is_some_and(|m| !m.is_file()) {
            return in_place(fill);
        }
        let dir = match target.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let mut name = std::ffi::OsString::from(".");
        name.push(target.file_name().unwrap_or_default());
        name.push(format!(".{}.tmp", std::process::id()));
        let temp = dir.join(name);
        let file = match OpenOptions::new().write(true).create_new(true).open(&temp) {
            Ok(f) => f,
            // A directory this run cannot add to, holding a file it may
            // write (`check` opened it): written in place.
            Err(_) => return in_place(fill),
        };
        let written = existing
            .map_or(Ok(()), |m| file.set_permissions(m.permissions()))
            .and_then(|()| fill_and_sync(file, fill))
            .and_then(|()| std::fs::rename(&temp, &target));
        if written.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
        written.map_err(fail)
    }

    /// Writes `bytes` as the file.
    pub fn write(&self, bytes: &[u8]) -> Result<(), Error> {
        self.write_with(|w| w.write_all(bytes))
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
