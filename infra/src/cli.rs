//! The service binaries' one argument parser: clap's builder (no derive, no colour, no
//! suggestions: only crates already in the lock file), with what the binaries share — the
//! `--config PATH` option and its fallbacks, and how help and usage errors end the process.
//!
//! Each binary declares its own commands and options with the re-exported [`Command`] and
//! [`Arg`], and its version with [`version!`](crate::version); [`parse`] runs them. Help (`-h`, `--help`,
//! `help`, or no command where one is needed) and `--version` (`-V`) go to stdout with exit
//! status 0; an unknown or malformed argument is refused by name on stderr with exit status
//! 2 ([`exit::USAGE`]). The exit statuses every binary keeps are in [`exit`].

use std::ffi::OsString;
use std::path::PathBuf;

/// clap itself, for its `value_parser!` in the binaries (which do not depend on it).
pub use clap;
use clap::error::ErrorKind;
pub use clap::{Arg, ArgAction, ArgMatches, Command};

/// The exit statuses of every binary, for scripts (docs/operations.md, "Exit statuses").
pub mod exit {
    /// Done.
    pub const OK: u8 = 0;
    /// It failed (a service unreachable, a configuration refused, a check that did not pass).
    pub const FAILURE: u8 = 1;
    /// The command line is wrong: an unknown command or option, a missing or malformed value.
    pub const USAGE: u8 = 2;
    /// `parsley-projector status`: it ran, and a task (or a model) is refused.
    pub const REFUSED: u8 = 3;
}

/// The text `--version` prints after the binary's name: the calling package's version and
/// the commit it was built from, e.g. `0.2.0 (commit 6ecaae3bc2f9)` (`unknown` when the build
/// had neither git nor `PARSLEY_BUILD_COMMIT`). Expanded in the binary's own package, whose
/// build script (`build/commit.rs`, shared) sets `PARSLEY_BUILD_COMMIT`.
#[macro_export]
macro_rules! version {
    () => {
        concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("PARSLEY_BUILD_COMMIT"), ")")
    };
}

/// The environment variable naming the configuration file when `--config` is not given.
pub const ENV_CONFIG: &str = "PARSLEY_CONFIG";
/// The configuration file when neither `--config` nor [`ENV_CONFIG`] names one.
pub const DEFAULT_CONFIG: &str = "config/parsley.toml";

/// `--config PATH`, accepted before or after a subcommand.
pub fn config_arg() -> Arg {
    Arg::new("config")
        .long("config")
        .value_name("PATH")
        .value_parser(clap::value_parser!(PathBuf))
        .action(ArgAction::Set)
        .global(true)
        .help(format!("the configuration file (else ${ENV_CONFIG}, else {DEFAULT_CONFIG})"))
}

/// The configuration file: `--config`, else `$PARSLEY_CONFIG` (read through `var`), else
/// `config/parsley.toml`.
pub fn config_path(matches: &ArgMatches, var: impl Fn(&str) -> Option<OsString>) -> PathBuf {
    matches
        .get_one::<PathBuf>("config")
        .cloned()
        .or_else(|| var(ENV_CONFIG).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG))
}

/// What parsing decided: go on with the matches, or end the process (help printed, or a
/// usage error) with this text on this stream and this status.
#[derive(Debug)]
pub enum Parsed {
    Run(ArgMatches),
    Exit { stdout: bool, text: String, status: u8 },
}

/// Parses `args` (the program name first) against `command`, without printing or exiting.
/// A leading `help` word asks for help, as `--help` does, even for a binary without
/// subcommands. `--version` is offered when `command` has a version ([`version!`](crate::version)).
pub fn try_parse(command: Command, args: impl IntoIterator<Item = OsString>) -> Parsed {
    let mut args: Vec<OsString> = args.into_iter().collect();
    let has_subcommands = command.get_subcommands().next().is_some();
    if !has_subcommands && args.get(1).is_some_and(|a| a == "help") {
        args[1] = OsString::from("--help");
    }
    let mut command = if command.get_version().is_some() { command } else { command.disable_version_flag(true) };
    if has_subcommands {
        command = command.subcommand_required(true).arg_required_else_help(true);
    }
    match command.try_get_matches_from(args) {
        Ok(matches) => Parsed::Run(matches),
        Err(e) => match e.kind() {
            ErrorKind::DisplayHelp
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            | ErrorKind::DisplayVersion => {
                Parsed::Exit { stdout: true, text: e.render().to_string(), status: exit::OK }
            }
            _ => Parsed::Exit { stdout: false, text: e.render().to_string(), status: exit::USAGE },
        },
    }
}

/// Parses the process's arguments against `command`; prints help (or the version) and
/// exits 0, or prints the refusal and exits 2.
pub fn parse(command: Command) -> ArgMatches {
    match try_parse(command, std::env::args_os()) {
        Parsed::Run(matches) => matches,
        Parsed::Exit { stdout, text, status } => {
            if stdout {
                print!("{text}");
            } else {
                eprint!("{text}");
            }
            std::process::exit(i32::from(status));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        std::iter::once("prog").chain(list.iter().copied()).map(OsString::from).collect()
    }

    fn with_commands() -> Command {
        Command::new("prog")
            .arg(config_arg())
            .subcommand(
                Command::new("run").about("run it").arg(Arg::new("model").long("model").action(ArgAction::Append)),
            )
            .subcommand(Command::new("migrate").about("migrate it"))
    }

    fn exit(parsed: Parsed) -> (bool, String, u8) {
        match parsed {
            Parsed::Exit { stdout, text, status } => (stdout, text, status),
            Parsed::Run(m) => panic!("expected an exit, got {m:?}"),
        }
    }

    #[test]
    fn help_goes_to_stdout_with_status_0() {
        for list in [&[][..], &["--help"], &["-h"], &["help"], &["help", "run"], &["run", "--help"]] {
            let (stdout, text, status) = exit(try_parse(with_commands(), args(list)));
            assert!(stdout && status == 0, "{list:?}: {text}");
            assert!(text.contains("Usage:"), "{list:?}: {text}");
        }
        let (stdout, text, status) = exit(try_parse(Command::new("solo").arg(config_arg()), args(&["help"])));
        assert!(stdout && status == 0 && text.contains("--config <PATH>"), "{text}");
    }

    #[test]
    fn unknown_arguments_are_refused_by_name_with_status_2() {
        for (list, name) in [
            (&["run", "--nope"][..], "--nope"),
            (&["frobnicate"], "frobnicate"),
            (&["run", "--config"], "--config"),
            (&["migrate", "--model", "m"], "--model"),
        ] {
            let (stdout, text, status) = exit(try_parse(with_commands(), args(list)));
            assert!(!stdout && status == exit::USAGE, "{list:?}: {text}");
            assert!(text.contains(name), "{list:?} does not name {name}: {text}");
        }
        let (_, text, status) = exit(try_parse(Command::new("solo").arg(config_arg()), args(&["extra"])));
        assert!(status == exit::USAGE && text.contains("extra"), "{text}");
    }

    #[test]
    fn the_version_goes_to_stdout_with_status_0_when_the_binary_has_one() {
        let versioned = || with_commands().version("1.2.3 (commit abc123)");
        for list in [&["--version"][..], &["-V"]] {
            let (stdout, text, status) = exit(try_parse(versioned(), args(list)));
            assert!(stdout && status == exit::OK, "{list:?}: {text}");
            assert_eq!(text, "prog 1.2.3 (commit abc123)\n");
        }
        let (stdout, _, status) = exit(try_parse(with_commands(), args(&["--version"])));
        assert!(!stdout && status == exit::USAGE, "without a version, --version is an unknown argument");
    }

    #[test]
    fn the_config_path_falls_back_to_the_environment_then_the_default() {
        let Parsed::Run(m) = try_parse(with_commands(), args(&["run", "--config", "a.toml", "--model", "x"])) else {
            panic!()
        };
        assert_eq!(config_path(&m, |_| Some("b.toml".into())), PathBuf::from("a.toml"));
        let Parsed::Run(m) = try_parse(with_commands(), args(&["--config", "a.toml", "run"])) else { panic!() };
        assert_eq!(config_path(&m, |_| None), PathBuf::from("a.toml"), "before the command too");
        let Parsed::Run(m) = try_parse(with_commands(), args(&["run"])) else { panic!() };
        assert_eq!(config_path(&m, |v| (v == ENV_CONFIG).then(|| "b.toml".into())), PathBuf::from("b.toml"));
        assert_eq!(config_path(&m, |_| None), PathBuf::from(DEFAULT_CONFIG));
    }
}
