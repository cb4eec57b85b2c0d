//! What a setting is: its name, help, shape and default, how its text is
//! read, and the ranges it is held to.
//!
//! Each setting is declared once, in [`RelayConfig`](super::RelayConfig)'s
//! `settings!` block: a field with its doc comment (the help), its type and
//! its default, and the rule it must meet. The flag, the `OUTBOX_*`
//! variable and the config-file key are all derived from the field's name,
//! and every source of text (flags, the environment, the file) is read by the
//! same [`Value`] parser, so the four cannot drift apart.

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use super::{RelayConfig, Retention};

/// One setting of the relay.
pub struct Setting {
    /// The field's name, which is also the config-file key.
    pub key: &'static str,
    pub(super) help: &'static str,
    /// The value may hold a secret: it is shown only masked, and `--help`
    /// does not show its environment variable's value.
    pub secret: bool,
    /// How the value is written on a command line.
    pub shape: Shape,
    /// The words the value may be, for settings with a fixed set of them.
    pub choices: fn() -> Vec<&'static str>,
    pub(super) show: fn(&RelayConfig) -> Option<String>,
    pub(super) apply: fn(&mut RelayConfig, &[String]) -> Result<(), String>,
    pub(super) check: fn(&RelayConfig) -> Result<(), Problem>,
}

/// How a setting's value is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One value.
    One,
    /// A list: the flag repeated, or values separated by commas.
    Many,
    /// On or off; the flag alone means on.
    Switch,
}

/// Where a setting's value was given, to name it in an error the way the
/// user wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A command-line flag.
    Flag,
    /// An `OUTBOX_*` environment variable.
    Environment,
    /// A key in this config file.
    File(PathBuf),
}

/// A setting's value as given, before it is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Given {
    /// The value's text: one entry, or one per list item.
    pub values: Vec<String>,
    /// Where it came from.
    pub origin: Origin,
}

/// Why a setting's value cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// A required setting has no value.
    Missing,
    /// The value is outside what the setting allows.
    OutOfRange { low: String, high: String },
}

impl Setting {
    /// The command-line flag, without its dashes: `ack-timeout`.
    pub fn flag(&self) -> String {
        self.key.replace('_', "-")
    }

    /// The environment variable: `OUTBOX_ACK_TIMEOUT`.
    pub fn env(&self) -> String {
        format!("OUTBOX_{}", self.key.to_ascii_uppercase())
    }

    /// The help text, one sentence or more, without the final stop.
    pub fn help(&self) -> &'static str {
        let help = self.help.trim();
        help.strip_suffix('.').unwrap_or(help)
    }

    /// The default as it would be written, or `None` if the setting is
    /// unset by default.
    pub fn default_text(&self) -> Option<String> {
        (self.show)(&RelayConfig::default())
    }

    /// The value in `config`, as it would be written.
    pub fn shown(&self, config: &RelayConfig) -> Option<String> {
        (self.show)(config)
    }

    /// Whether the setting must be given.
    pub fn required(&self) -> bool {
        (self.check)(&RelayConfig::default()) == Err(Problem::Missing)
    }

    /// Reads `given` into `config`, or says what is wrong with it.
    pub(super) fn apply(&self, config: &mut RelayConfig, given: &Given) -> Result<(), String> {
        (self.apply)(config, &given.values)
            .map_err(|reason| format!("{} {reason}", self.named(Some(given), config)))
    }

    /// Checks the value in `config`, naming it as it was given.
    pub(super) fn check(&self, config: &RelayConfig, given: Option<&Given>) -> Result<(), String> {
        match (self.check)(config) {
            Ok(()) => Ok(()),
            Err(Problem::Missing) if given.is_some() => {
                Err(format!("{} must not be empty", self.named(given, config)))
            }
            Err(Problem::Missing) => Err(format!(
                "{} is not set: pass --{}, set {}, or write {} in the config file",
                self.flag(),
                self.flag(),
                self.env(),
                self.key
            )),
            Err(Problem::OutOfRange { low, high }) => Err(format!(
                "{} is out of range: it must be from {low} to {high}",
                self.named(given, config)
            )),
        }
    }

    /// A value of this setting as it may be shown.
    fn masked(&self, value: &str) -> String {
        if self.secret {
            crate::redact::uri(value)
        } else {
            value.to_owned()
        }
    }

    /// The setting and its value, as the user wrote them.
    fn named(&self, given: Option<&Given>, config: &RelayConfig) -> String {
        let Some(given) = given else {
            let value = self.shown(config).unwrap_or_default();
            return format!("{} = {}", self.flag(), self.masked(&value));
        };
        let value = given.values.join(",");
        let value = format!("{:?}", self.masked(&value));
        match &given.origin {
            Origin::Flag => format!("--{} {value}", self.flag()),
            Origin::Environment => format!("{}={value}", self.env()),
            Origin::File(path) => format!("{} = {value} in {}", self.key, path.display()),
        }
    }
}

/// A type a setting can have: how its text is read and written back.
pub trait Value: Sized {
    /// How the value is written on a command line.
    const SHAPE: Shape = Shape::One;
    /// The words the value may be, if it is one of a fixed set.
    fn choices() -> Vec<&'static str> {
        Vec::new()
    }

    /// Reads one value; the error completes "<setting> <value> ...".
    fn parse(text: &str) -> Result<Self, String>;

    /// The value as it would be written; `None` for unset.
    fn show(&self) -> Option<String>;

    /// Reads the value from what was given: by default, exactly one text.
    fn read(values: &[String]) -> Result<Self, String> {
        match values {
            [one] => Self::parse(one.trim()),
            _ => Err("takes one value, not a list".to_owned()),
        }
    }
}

impl Value for String {
    fn parse(text: &str) -> Result<Self, String> {
        Ok(text.to_owned())
    }
    fn show(&self) -> Option<String> {
        Some(self.clone()).filter(|text| !text.is_empty())
    }
}

impl Value for Option<String> {
    fn parse(text: &str) -> Result<Self, String> {
        Ok(Some(text.to_owned()).filter(|t| !t.is_empty()))
    }
    fn show(&self) -> Option<String> {
        self.clone()
    }
}

impl Value for Vec<String> {
    const SHAPE: Shape = Shape::Many;
    fn parse(text: &str) -> Result<Self, String> {
        Ok(vec![text.to_owned()])
    }
    fn show(&self) -> Option<String> {
        Some(self.join(",")).filter(|t| !t.is_empty())
    }
    /// A list is read alike from every source: items separated by commas
    /// (as clap splits a flag), each trimmed; an empty item is a mistake.
    fn read(values: &[String]) -> Result<Self, String> {
        values
            .iter()
            .flat_map(|value| value.split(','))
            .map(|item| match item.trim() {
                "" => Err("has an empty item; separate items with single commas".to_owned()),
                item => Ok(item.to_owned()),
            })
            .collect()
    }
}

impl Value for Duration {
    fn parse(text: &str) -> Result<Self, String> {
        humantime::parse_duration(text).map_err(|e| {
            format!("is not a duration ({e}); write it like \"500ms\", \"10s\" or \"5m\"")
        })
    }
    fn show(&self) -> Option<String> {
        Some(humantime::format_duration(*self).to_string())
    }
}

/// A duration, or "off" for none.
impl Value for Option<Duration> {
    fn parse(text: &str) -> Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "off" | "none" => Ok(None),
            _ => Duration::parse(text)
                .map(Some)
                .map_err(|why| format!("{why}, or \"off\"")),
        }
    }
    fn show(&self) -> Option<String> {
        self.and_then(|d| d.show())
    }
}

/// A retention: a duration, or "off" for none; unset leaves it alone.
impl Value for Option<Retention> {
    fn parse(text: &str) -> Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "off" | "none" => Ok(Some(Retention::Off)),
            _ => Duration::parse(text)
                .map(|keep| Some(Retention::Keep(keep)))
                .map_err(|why| format!("{why}, or \"off\"")),
        }
    }
    fn show(&self) -> Option<String> {
        match self {
            None => None,
            Some(Retention::Off) => Some("off".to_owned()),
            Some(Retention::Keep(keep)) => keep.show(),
        }
    }
}

/// A file's path; empty for none.
impl Value for Option<PathBuf> {
    fn parse(text: &str) -> Result<Self, String> {
        Ok(Some(PathBuf::from(text)).filter(|path| !path.as_os_str().is_empty()))
    }
    fn show(&self) -> Option<String> {
        self.as_ref().map(|path| path.display().to_string())
    }
}

/// Whole numbers: counts and limits.
macro_rules! whole_number {
    ($($ty:ty),+) => {$(
        impl Value for $ty {
            fn parse(text: &str) -> Result<Self, String> {
                text.parse()
                    .map_err(|_| "is not a whole number".to_owned())
            }
            fn show(&self) -> Option<String> {
                Some(self.to_string())
            }
        }
    )+};
}
whole_number!(u32, usize);

/// A size in bytes, written as a number with an optional unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Bytes(pub u64);

impl Bytes {
    const UNITS: [(&'static str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];

    /// So many mebibytes.
    pub const fn mib(n: u64) -> Bytes {
        Bytes(n << 20)
    }
}

impl Value for Bytes {
    fn parse(text: &str) -> Result<Self, String> {
        let split = text
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let scale: u64 = match unit.trim() {
            "" | "B" => 1,
            "k" | "K" | "KiB" | "kB" | "KB" => 1 << 10,
            "M" | "MiB" | "MB" => 1 << 20,
            "G" | "GiB" | "GB" => 1 << 30,
            _ => 0,
        };
        number
            .parse::<u64>()
            .ok()
            .filter(|_| scale > 0)
            .and_then(|n| n.checked_mul(scale))
            .map(Bytes)
            .ok_or_else(|| {
                "is not a size; write it like \"67108864\", \"64MiB\" or \"1GiB\"".to_owned()
            })
    }
    fn show(&self) -> Option<String> {
        let unit = Self::UNITS
            .iter()
            .find(|(_, size)| self.0 >= *size && self.0.is_multiple_of(*size));
        Some(match unit {
            Some((name, size)) => format!("{}{name}", self.0 / size),
            None => self.0.to_string(),
        })
    }
}

impl Value for bool {
    const SHAPE: Shape = Shape::Switch;
    fn parse(text: &str) -> Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "true" | "yes" | "on" | "1" => Ok(true),
            "false" | "no" | "off" | "0" => Ok(false),
            _ => Err("is neither true nor false".to_owned()),
        }
    }
    fn show(&self) -> Option<String> {
        Some(self.to_string())
    }
}

/// A socket address, or "off" for none.
impl Value for Option<SocketAddr> {
    fn parse(text: &str) -> Result<Self, String> {
        match text {
            "off" | "none" | "" => Ok(None),
            addr => addr.parse().map(Some).map_err(|_| {
                "is not an address; write it like \"127.0.0.1:9464\" or \"0.0.0.0:9464\", or \
                 \"off\" for none"
                    .to_owned()
            }),
        }
    }
    fn show(&self) -> Option<String> {
        Some(self.map_or_else(|| "off".to_owned(), |addr| addr.to_string()))
    }
}

/// A value that is one of a few words.
pub(super) trait Named: Copy + PartialEq + 'static {
    const NAMES: &'static [(&'static str, Self)];
}

impl<T: Named> Value for T {
    fn choices() -> Vec<&'static str> {
        T::NAMES.iter().map(|(name, _)| *name).collect()
    }
    fn parse(text: &str) -> Result<Self, String> {
        T::NAMES
            .iter()
            .find(|(name, _)| *name == text)
            .map(|(_, value)| *value)
            .ok_or_else(|| format!("is not one of {}", Self::choices().join(", ")))
    }
    fn show(&self) -> Option<String> {
        T::NAMES
            .iter()
            .find(|(_, value)| value == self)
            .map(|(name, _)| (*name).to_owned())
    }
}

/// The rule of a setting that must be given.
pub(super) fn required(value: &str) -> Result<(), Problem> {
    if value.trim().is_empty() {
        Err(Problem::Missing)
    } else {
        Ok(())
    }
}

/// A value that a range can bound: itself, or what an `Option` holds.
pub(super) trait Bounded {
    type Bound: PartialOrd + Value;
    fn bounded(&self) -> Option<&Self::Bound>;
}

/// Types a range bounds directly.
macro_rules! bounded_by_itself {
    ($($ty:ty),+) => {$(
        impl Bounded for $ty {
            type Bound = $ty;
            fn bounded(&self) -> Option<&$ty> {
                Some(self)
            }
        }
    )+};
}
bounded_by_itself!(Duration, u32, usize, Bytes);

impl Bounded for Option<Duration> {
    type Bound = Duration;
    fn bounded(&self) -> Option<&Duration> {
        self.as_ref()
    }
}

impl Bounded for Option<Retention> {
    type Bound = Duration;
    fn bounded(&self) -> Option<&Duration> {
        match self {
            Some(Retention::Keep(keep)) => Some(keep),
            _ => None,
        }
    }
}

/// The rule of a setting that must lie in `range` (when set).
pub(super) fn within<T: Bounded>(
    range: RangeInclusive<T::Bound>,
) -> impl Fn(&T) -> Result<(), Problem> {
    move |value| match value.bounded() {
        Some(value) if !range.contains(value) => Err(Problem::OutOfRange {
            low: range.start().show().unwrap_or_default(),
            high: range.end().show().unwrap_or_default(),
        }),
        _ => Ok(()),
    }
}

/// Declares the relay's settings: the struct, its defaults and its table.
///
/// Each entry is a field with its doc comment (the help), its type,
/// `[secret]` if its value may hold one (it is then only ever shown
/// masked), its default, and optionally a rule (`within(..)`, `required`).
macro_rules! settings {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $(
                $(#[doc = $doc:literal])+
                $key:ident: $ty:ty $([$secret:ident])? = $default:expr $(, $rule:expr)?;
            )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq)]
        pub struct $name {
            $( $(#[doc = $doc])+ pub $key: $ty, )+
        }

        /// Secret settings are shown masked, so that no log or panic of a
        /// configuration shows a password.
        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    $( .field(stringify!($key), &settings!(@debug self.$key $(, $secret)?)) )+
                    .finish()
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $name { $( $key: $default, )+ }
            }
        }

        impl $name {
            /// Every setting, in the order help and README list them.
            pub const SETTINGS: &'static [$crate::config::Setting] = &[$(
                $crate::config::Setting {
                    key: stringify!($key),
                    help: concat!($($doc),+),
                    secret: settings!(@secret $($secret)?),
                    shape: <$ty as $crate::config::Value>::SHAPE,
                    choices: <$ty as $crate::config::Value>::choices,
                    show: |config| $crate::config::Value::show(&config.$key),
                    apply: |config, values| {
                        config.$key = <$ty as $crate::config::Value>::read(values)?;
                        Ok(())
                    },
                    check: |config| settings!(@rule config.$key $(, $rule)?),
                },
            )+];
        }
    };
    (@secret secret) => { true };
    (@secret) => { false };
    (@debug $value:expr) => { $value };
    (@debug $value:expr, secret) => { $crate::redact::uri(&$value) };
    (@rule $value:expr) => {{ let _ = &$value; Ok(()) }};
    (@rule $value:expr, $rule:expr) => { ($rule)(&$value) };
}
pub(super) use settings;
