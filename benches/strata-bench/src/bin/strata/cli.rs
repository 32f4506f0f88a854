//! Arguments and configuration as the user gave them: clap's errors as one
//! line, the config's errors naming where the bad value came from, input
//! files checked before they are read.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::error::ErrorKind as ClapKind;
use clap::{ArgMatches, Command, CommandFactory, FromArgMatches};

use strata::config::Config;
use strata::sys::Topology;
use strata::Error;

use crate::out;

/// Size arguments, parsed by `strata::size::parse_size` (which names the
/// flag); taking hyphen values lets `--size -5M` reach it instead of
/// clap's "unexpected argument".
const SIZE_ARGS: [&str; 13] = [
    "size",
    "bs",
    "page_sizes",
    "page_size",
    "cxl_bandwidth",
    "expert_bytes",
    "chunk",
    "device_budget",
    "data",
    "dram",
    "cxl",
    "read_bytes",
    "row_bytes",
];

fn prepare(cmd: Command) -> Command {
    cmd.mut_args(|a| {
        if !a.get_action().takes_values() {
            a
        } else if SIZE_ARGS.contains(&a.get_id().as_str()) {
            a.allow_hyphen_values(true)
        } else {
            // `--qd -1` is then "invalid value '-1' for '--qd <QD>'".
            a.allow_negative_numbers(true)
        }
    })
    .mut_subcommands(prepare)
}

/// Parses the command line. `--help` and `--version` print as clap does,
/// status 0; every usage error is one line on stderr, status 2.
pub fn parse<T: CommandFactory + FromArgMatches>() -> Result<T, ExitCode> {
    let matches: ArgMatches = prepare(T::command()).try_get_matches().map_err(report)?;
    T::from_arg_matches(&matches).map_err(report)
}

fn report(e: clap::Error) -> ExitCode {
    match e.kind() {
        ClapKind::DisplayHelp | ClapKind::DisplayVersion => {
            // A closed stdout is no failure of `--help`.
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ClapKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            out::warn(format_args!(
                "strata: {} (see --help)",
                missing_subcommand()
            ));
            ExitCode::from(2)
        }
        _ => {
            // The first paragraph, joined: "the following required
            // arguments were not provided: --trace <TRACE>".
            let text = e.render().to_string();
            let first: Vec<&str> = text
                .lines()
                .take_while(|l| !l.trim().is_empty())
                .map(str::trim)
                .collect();
            let line = first.join(" ");
            let line = line.strip_prefix("error: ").unwrap_or(&line);
            out::warn(format_args!("strata: {line} (see --help)"));
            ExitCode::from(2)
        }
    }
}

/// "strata bench needs a subcommand: io, copy, …" from the words given.
fn missing_subcommand() -> String {
    let mut cmd = prepare(crate::Cli::command());
    let mut words: Vec<String> = Vec::new();
    for arg in std::env::args().skip(1) {
        if arg.starts_with('-') {
            continue;
        }
        match cmd.find_subcommand(&arg) {
            Some(sub) => {
                words.push(arg.clone());
                cmd = sub.clone();
            }
            None => break,
        }
    }
    let subs: Vec<&str> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .map(|s| s.get_name())
        .filter(|n| *n != "help")
        .collect();
    if words.is_empty() {
        format!("a subcommand is needed: {}", subs.join(", "))
    } else {
        format!(
            "{} needs a subcommand: {}",
            words.join(" "),
            subs.join(", ")
        )
    }
}

/// The config file in use and how it was named.
fn config_file(flag: Option<&Path>) -> Option<(PathBuf, &'static str)> {
    match flag {
        Some(p) => Some((p.to_path_buf(), "--config")),
        None => std::env::var_os("STRATA_CONFIG").map(|p| (PathBuf::from(p), "$STRATA_CONFIG")),
    }
}

/// A config file named (`--config` or `$STRATA_CONFIG`) is read and
/// checked before any command runs, whether or not that command takes a
/// setting from it: a missing or malformed file is never silently passed
/// over.
pub fn check_named_config(flag: Option<&Path>) -> Result<(), Error> {
    if config_file(flag).is_some() {
        load_config(flag)?;
    }
    Ok(())
}

/// [`Config::load`], with an error that says where the bad value came
/// from: the file and line, or the environment variable. The library's
/// message names the key; which source set it is found by resolving again
/// without each candidate.
pub fn load_config(flag: Option<&Path>) -> Result<Config, Error> {
    let file = config_file(flag);
    if let Some((path, how)) = &file {
        if path.as_os_str().is_empty() {
            return Err(Error::invalid(format!(
                "{how} is empty: name a config file{}",
                if *how == "--config" {
                    ""
                } else {
                    ", or unset it"
                }
            )));
        }
        if path.is_dir() {
            return Err(Error::invalid(format!(
                "{how} {} is a directory, not a config file",
                path.display()
            )));
        }
        // A device or a pipe could be endless (/dev/zero): never read.
        if path.exists() && !path.is_file() {
            return Err(Error::invalid(format!(
                "{how} {} is not a regular file",
                path.display()
            )));
        }
    }
    let e = match Config::load(flag) {
        Ok(c) => return Ok(c),
        Err(e) => e,
    };
    let Some(text) = file
        .as_ref()
        .and_then(|(p, _)| std::fs::read_to_string(p).ok())
        .or_else(|| file.is_none().then(String::new))
    else {
        // The file could not be read: the message names it already.
        return Err(e);
    };
    let topology = Topology::detect();
    let no_env = |_: &str| None;
    let text_opt = file.as_ref().map(|_| text.as_str());
    if let Some((path, how)) = &file {
        if Config::resolve(text_opt, &no_env, &topology).is_err() {
            // The file alone is bad: the one line whose number the message
            // names, or else the line whose removal mends it (of several,
            // one whose key the message names).
            let lines: Vec<&str> = text.lines().collect();
            let mending: Vec<usize> = (0..lines.len().min(10_000))
                .filter(|&i| {
                    let mended: String = lines
                        .iter()
                        .enumerate()
                        .map(|(j, l)| if j == i { "" } else { *l })
                        .collect::<Vec<_>>()
                        .join("\n");
                    Config::resolve(Some(&mended), &no_env, &topology).is_ok()
                })
                .collect();
            let message = e.message();
            let part = |i: usize, which: usize| {
                lines[i]
                    .split_once('=')
                    .map(|kv| if which == 0 { kv.0 } else { kv.1 })
                    .map(|x| x.trim().trim_matches('"').to_string())
                    .filter(|x| !x.is_empty())
            };
            // A number the message repeats points at its line (a word such
            // as "emulated" may be the message's own).
            let valued: Vec<usize> = (0..lines.len())
                .filter(|&i| {
                    part(i, 1).is_some_and(|x| {
                        x.parse::<f64>().is_ok() && x.len() > 1 && message.contains(&x)
                    })
                })
                .collect();
            let keyed = mending
                .iter()
                .copied()
                .find(|&i| part(i, 0).is_some_and(|x| message.contains(&x)));
            // The number's line only where taking it out mends the file
            // (a page size the message quotes is not the capacity at fault).
            let culprit = match valued[..] {
                [one] if mending.is_empty() || mending.contains(&one) => Some(one),
                _ => keyed.or(mending.first().copied()),
            };
            let at = match culprit {
                Some(i) => format!("{} line {}", path.display(), i + 1),
                None => path.display().to_string(),
            };
            return Err(e.context(format!("{at} ({how})")));
        }
    }
    // The environment is bad: find the variable whose absence mends it.
    let vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("STRATA_") && k != "STRATA_CONFIG")
        .collect();
    for (key, value) in &vars {
        let without = |k: &str| {
            if k == key {
                None
            } else {
                std::env::var(k).ok()
            }
        };
        if Config::resolve(text_opt, &without, &topology).is_ok() {
            if e.message().contains(key.as_str()) {
                return Err(e);
            }
            return Err(e.context(format!("{key}={value:?} (environment)")));
        }
    }
    Err(e)
}

/// The NVMe path the configuration sets (`STRATA_NVME_PATH`, or `[nvme]
/// path` in the config file), `None` where it only has the default.
pub fn configured_nvme_path(flag: Option<&Path>) -> Result<Option<PathBuf>, Error> {
    let env_set = std::env::var_os("STRATA_NVME_PATH").is_some();
    let file = config_file(flag);
    if !env_set && file.is_none() {
        return Ok(None);
    }
    let config = load_config(flag)?;
    let file_path = file
        .and_then(|(p, _)| std::fs::read_to_string(p).ok())
        .and_then(|t| t.parse::<toml::Table>().ok())
        .and_then(|t| {
            t.get("nvme")
                .and_then(|n| n.get("path"))
                .and_then(|p| p.as_str().map(PathBuf::from))
        });
    if let Some(n) = config.nvme.filter(|_| env_set || file_path.is_some()) {
        return Ok(Some(n.path));
    }
    // A capacity of 0 turns the runtime's NVMe tier off, not the path the
    // benches read and write.
    Ok(std::env::var_os("STRATA_NVME_PATH")
        .map(PathBuf::from)
        .or(file_path))
}

/// Checks an input file named by `flag` before it is read: it exists and
/// is not a directory (reading one is "Is a directory" at line 1).
pub fn input_file(flag: &str, path: &Path) -> Result<(), Error> {
    // "--trace t.txt", "--graph file:g.el".
    let flag = if flag.ends_with(':') {
        flag.to_string()
    } else {
        format!("{flag} ")
    };
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Err(Error::invalid(format!(
            "{flag}{} is a directory, not a file",
            path.display()
        ))),
        // A device or a pipe has no length to check its contents against
        // (/dev/zero is one endless line).
        Ok(m) if !m.is_file() => Err(Error::invalid(format!(
            "{flag}{} is not a regular file",
            path.display()
        ))),
        Ok(_) => Ok(()),
        Err(e) => Err(Error::invalid(format!(
            "{flag}{}: {}",
            path.display(),
            out::describe(&e)
        ))),
    }
}

/// Refuses a list flag that names the same entry twice (each would run,
/// and report, twice): `shown` spells an entry as the flag takes it.
pub fn no_repeats<T: PartialEq>(
    flag: &str,
    items: &[T],
    shown: impl Fn(&T) -> String,
) -> Result<(), Error> {
    match items
        .iter()
        .enumerate()
        .find(|(i, x)| items[..*i].contains(x))
    {
        Some((_, x)) => Err(Error::invalid(format!("{flag} names {} twice", shown(x)))),
        None => Ok(()),
    }
}

/// Checks a command's input file (`input`, named by `flag`, where one is
/// given) and that no output names it or another output's file.
pub fn input_and_outputs(
    flag: &str,
    input: Option<&Path>,
    outputs: &[(&str, Option<&Path>)],
) -> Result<(), Error> {
    if let Some(path) = input {
        input_file(flag, path)?;
    }
    let mut all = vec![(flag, input)];
    all.extend_from_slice(outputs);
    out::distinct_files(&all)
}
