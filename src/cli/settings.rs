//! The relay's settings on the command line.
//!
//! Every relay setting can come from a flag, its `OUTBOX_*` environment
//! variable, or the `--config` TOML file, in that order of strength. The
//! flags are built from the settings' declarations in the library
//! ([`RelayConfig::SETTINGS`]), so names, help and defaults are written once.

use std::collections::HashMap;
use std::path::PathBuf;

use clap::builder::PossibleValuesParser;
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Args, FromArgMatches};
use outbox_relay::config::{Given, Origin, Setting, SettingsFile, Shape};
use outbox_relay::{RelayConfig, Result};

/// The relay's settings on the command line: `--config` and one flag per
/// [`RelayConfig::SETTINGS`] entry, each with its `OUTBOX_*` variable.
///
/// Only values given as flags or in the environment are kept here; the
/// defaults clap shows in `--help` are left out, so that a config file's
/// value beats them when the settings are resolved.
#[derive(Debug, Clone, Default)]
pub struct RunArgs {
    config: Option<PathBuf>,
    given: HashMap<&'static str, Given>,
}

impl RunArgs {
    /// Combines flags, the environment, the config file and the defaults,
    /// strongest first, into a checked configuration.
    pub fn resolve(self) -> Result<RelayConfig> {
        let file = match &self.config {
            Some(path) => SettingsFile::load(path)?,
            None => SettingsFile::default(),
        };
        let mut given = self.given;
        RelayConfig::resolve(|setting| {
            given
                .remove(setting.key)
                .or_else(|| file.get(setting.key).cloned())
        })
    }
}

const CONFIG: &str = "config";

impl Args for RunArgs {
    fn augment_args(command: clap::Command) -> clap::Command {
        let config = Arg::new(CONFIG)
            .long(CONFIG)
            .env("OUTBOX_CONFIG")
            .value_name("FILE")
            .value_parser(clap::value_parser!(PathBuf))
            .help("TOML file with any of these settings (flag names with '_' for '-')");
        RelayConfig::SETTINGS
            .iter()
            .fold(command.arg(config), |command, setting| {
                command.arg(setting_arg(setting))
            })
    }

    fn augment_args_for_update(command: clap::Command) -> clap::Command {
        Self::augment_args(command)
    }
}

/// The flag of one setting, from its declaration.
fn setting_arg(setting: &Setting) -> Arg {
    let mut arg = Arg::new(setting.key)
        .long(setting.flag())
        .env(setting.env())
        .help(setting.help())
        .hide_env_values(setting.secret)
        .value_name(setting.key.to_ascii_uppercase());
    arg = match setting.shape {
        Shape::One => arg.action(ArgAction::Set),
        Shape::Many => arg.action(ArgAction::Append).value_delimiter(','),
        Shape::Switch => arg
            .action(ArgAction::Set)
            .num_args(0..=1)
            .default_missing_value("true"),
    };
    let choices = (setting.choices)();
    if !choices.is_empty() {
        arg = arg.value_parser(PossibleValuesParser::new(choices));
    }
    if let Some(default) = setting.default_text() {
        arg = arg.default_value(default);
    }
    arg
}

impl FromArgMatches for RunArgs {
    fn from_arg_matches(matches: &ArgMatches) -> std::result::Result<Self, clap::Error> {
        let mut args = RunArgs::default();
        args.update_from_arg_matches(matches)?;
        Ok(args)
    }

    fn update_from_arg_matches(
        &mut self,
        matches: &ArgMatches,
    ) -> std::result::Result<(), clap::Error> {
        if let Some(path) = matches.get_one::<PathBuf>(CONFIG) {
            self.config = Some(path.clone());
        }
        for setting in RelayConfig::SETTINGS {
            let origin = match matches.value_source(setting.key) {
                Some(ValueSource::CommandLine) => Origin::Flag,
                Some(ValueSource::EnvVariable) => Origin::Environment,
                _ => continue,
            };
            let values = matches
                .get_many::<String>(setting.key)
                .map(|values| values.cloned().collect())
                .unwrap_or_default();
            self.given.insert(setting.key, Given { values, origin });
        }
        Ok(())
    }
}
