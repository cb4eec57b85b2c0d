//! The `--config` TOML file: every setting optional, keyed by its field
//! name (the flag with `_` for `-`). Durations are written as "500ms",
//! "10s", "2m", and read by the same parser as the flags.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::{Given, Origin, RelayConfig, Shape};
use crate::error::{Error, Result};

/// The settings a config file gives, checked against the known keys.
#[derive(Debug, Default)]
pub struct SettingsFile {
    given: HashMap<String, Given>,
}

/// The one flag that is not a setting of the file: logging starts before
/// the file is read.
const LOG_FORMAT: &str = "log_format";

impl SettingsFile {
    /// Reads and parses a TOML file; an unknown key or a value of the wrong
    /// kind is an error that names the file and the key.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Config(format!("cannot read config file {}: {e}", path.display()))
        })?;
        Self::parse(&text, path)
    }

    fn parse(text: &str, path: &Path) -> Result<Self> {
        let invalid = |why: String| {
            Error::Config(format!(
                "config file {} is not valid: {why}",
                path.display()
            ))
        };
        // A syntax error quotes its line, which may hold a connection string.
        let table: toml::Table =
            toml::from_str(text).map_err(|e| invalid(crate::redact::text(&e.to_string())))?;
        let mut given = HashMap::new();
        for (key, value) in table {
            let Some(setting) = RelayConfig::SETTINGS.iter().find(|s| s.key == key) else {
                if key == LOG_FORMAT {
                    return Err(invalid(format!(
                        "{LOG_FORMAT:?} is not read from a config file, as logging starts \
                         before the file is read; set --log-format or OUTBOX_LOG_FORMAT instead"
                    )));
                }
                return Err(invalid(format!(
                    "unknown key {key:?}; the keys are the flags' names with '_' for '-'"
                )));
            };
            let values = match (value, setting.shape) {
                (toml::Value::Array(items), Shape::Many) => {
                    items.into_iter().map(scalar).collect::<Option<Vec<_>>>()
                }
                (value, _) => scalar(value).map(|text| vec![text]),
            }
            .ok_or_else(|| {
                invalid(format!(
                    "{key} must be a string, a whole number or true/false"
                ))
            })?;
            let origin = Origin::File(PathBuf::from(path));
            given.insert(key, Given { values, origin });
        }
        Ok(SettingsFile { given })
    }

    /// What the file gives for the setting keyed `key`.
    pub fn get(&self, key: &str) -> Option<&Given> {
        self.given.get(key)
    }
}

/// A plain TOML value as text.
fn scalar(value: toml::Value) -> Option<String> {
    match value {
        toml::Value::String(text) => Some(text),
        toml::Value::Integer(n) => Some(n.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<SettingsFile> {
        SettingsFile::parse(text, Path::new("relay.toml"))
    }

    #[test]
    fn a_syntax_error_does_not_quote_a_password() {
        let error = parse("mongodb_uri = \"mongodb://app:s3cret@h/\" oops")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("relay.toml") && !error.contains("s3cret"),
            "{error}"
        );
    }

    #[test]
    fn rejects_unknown_keys_by_name() {
        let error = parse("nats_ulr = \"x\"").unwrap_err().to_string();
        assert!(
            error.contains("nats_ulr") && error.contains("relay.toml"),
            "{error}"
        );
    }

    #[test]
    fn says_where_the_log_format_is_set_instead() {
        let error = parse("log_format = \"json\"").unwrap_err().to_string();
        assert!(
            error.contains("OUTBOX_LOG_FORMAT") && error.contains("--log-format"),
            "{error}"
        );
    }

    #[test]
    fn reads_strings_numbers_switches_and_lists() {
        let file = parse(
            "batch_size = 30\nack_timeout = \"2s\"\ninstall_validator = true\n\
             allow_subject = [\"a.>\", \"b.>\"]\n",
        )
        .expect("a valid file");
        let values = |key: &str| file.get(key).map(|g| g.values.clone());
        assert_eq!(values("batch_size"), Some(vec!["30".to_owned()]));
        assert_eq!(values("ack_timeout"), Some(vec!["2s".to_owned()]));
        assert_eq!(values("install_validator"), Some(vec!["true".to_owned()]));
        assert_eq!(
            values("allow_subject"),
            Some(vec!["a.>".to_owned(), "b.>".to_owned()])
        );
        let error = parse("ack_timeout = [\"1s\"]").unwrap_err().to_string();
        assert!(error.contains("ack_timeout"), "{error}");
        let error = parse("batch_size = 1.5").unwrap_err().to_string();
        assert!(error.contains("whole number"), "{error}");
    }
}
