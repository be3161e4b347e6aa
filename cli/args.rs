//! What several commands' arguments share: the configuration file, and
//! flags as configuration overrides (each flag given sets its dotted key,
//! applied over the file and the environment).

use figment::value::Value;
use std::path::PathBuf;

/// The run configuration file, for the subcommands that read one.
#[derive(clap::Args)]
pub struct ConfigFile {
    /// Configuration file (.toml, .yaml or .json); FT_SECTION__KEY variables and flags override it.
    #[arg(long = "config", env = "FT_CONFIG_FILE")]
    pub path: Option<PathBuf>,
}

#[derive(Default)]
pub struct Overrides(pub Vec<(&'static str, Value)>);

impl Overrides {
    pub fn set<T: Into<Value>>(&mut self, key: &'static str, value: Option<T>) -> &mut Self {
        if let Some(value) = value {
            self.0.push((key, value.into()));
        }
        self
    }

    pub fn path(&mut self, key: &'static str, value: Option<&PathBuf>) -> &mut Self {
        self.set(key, value.map(|p| p.display().to_string()))
    }

    /// A value the configuration reads with serde (an enum such as a dtype).
    pub fn serialized<T: serde::Serialize>(&mut self, key: &'static str, value: Option<T>) -> &mut Self {
        self.set(key, value.map(|v| Value::serialize(v).expect("plain enums serialize")))
    }
}
