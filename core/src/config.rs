//! The run's configuration, layered with figment:
//! defaults ← config file (TOML, YAML or JSON) ← `FT_*` environment ← command-line flags.
//! Unknown keys are errors that name the key, where it came from, and the
//! closest known key.

use crate::comm::Backend;
use anyhow::{bail, Result};
use figment::providers::{Env, Format, Json, Serialized, Toml, Yaml};
use figment::value::Value;
use figment::Figment;
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub dist: DistConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// auto (NCCL when a GPU is visible, else Gloo), gloo or nccl.
    pub backend: Backend,
    /// Seconds that rendezvous and each collective may take before the run fails.
    pub timeout_secs: u64,
}

impl Default for DistConfig {
    fn default() -> Self {
        DistConfig { backend: Backend::Auto, timeout_secs: 300 }
    }
}

/// Environment variables `FT_SECTION__KEY` set `section.key`.
pub const ENV_PREFIX: &str = "FT_";

impl Config {
    /// Resolves the configuration. `overrides` are dotted keys from flags
    /// (e.g. `("dist.timeout_secs", 30.into())`), applied last.
    pub fn load(file: Option<&Path>, overrides: &[(&str, Value)]) -> Result<Config> {
        Config::load_with_env(file, overrides, Env::prefixed(ENV_PREFIX).split("__"))
    }

    fn load_with_env(file: Option<&Path>, overrides: &[(&str, Value)], env: Env) -> Result<Config> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            if !path.is_file() {
                bail!("config file {} does not exist", path.display());
            }
            let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            figment = match extension {
                "toml" => figment.merge(Toml::file(path)),
                "yaml" | "yml" => figment.merge(Yaml::file(path)),
                "json" => figment.merge(Json::file(path)),
                _ => bail!("config file {} must end in .toml, .yaml, .yml or .json", path.display()),
            };
        }
        figment = figment.merge(env);
        for (key, value) in overrides {
            figment = figment.merge(Serialized::default(key, value.clone()));
        }
        figment.extract().map_err(|e| anyhow::anyhow!(describe(e)))
    }
}

/// One line per problem: the key, its source, and a suggestion for a misspelling.
fn describe(error: figment::Error) -> String {
    let mut lines = vec![];
    for e in error {
        let source = e.metadata.as_ref().map(|m| match &m.source {
            Some(source) => format!("{} ({source})", m.name),
            None => m.name.to_string(),
        });
        let location = source.map(|s| format!(" in {s}")).unwrap_or_default();
        let line = match &e.kind {
            figment::error::Kind::UnknownField(field, expected) => {
                // figment's path already ends with the unknown field.
                let path = e.path.clone();
                let suggestion = expected
                    .iter()
                    .map(|known| (strsim::jaro_winkler(field, known), *known))
                    .filter(|(score, _)| *score > 0.8)
                    .max_by(|a, b| a.0.total_cmp(&b.0))
                    .map(|(_, known)| format!("; did you mean `{known}`?"))
                    .unwrap_or_default();
                format!(
                    "unknown config key `{}`{location}{suggestion} (known keys here: {})",
                    path.join("."),
                    expected.join(", ")
                )
            }
            _ => format!("config key `{}`{location}: {}", e.path.join("."), e.kind),
        };
        lines.push(line);
    }
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file(name: &str, body: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::File::create(&path).unwrap().write_all(body.as_bytes()).unwrap();
        (dir, path)
    }

    fn no_env() -> Env {
        Env::prefixed("FT_TEST_NOTHING_")
    }

    #[test]
    fn layers_apply_in_order() {
        let (_dir, path) = file("ft.toml", "[dist]\nbackend = 'gloo'\ntimeout_secs = 10\n");
        let config = Config::load_with_env(Some(&path), &[], no_env()).unwrap();
        assert_eq!(config.dist, DistConfig { backend: Backend::Gloo, timeout_secs: 10 });
        let config = Config::load_with_env(Some(&path), &[("dist.timeout_secs", 42.into())], no_env()).unwrap();
        assert_eq!(config.dist.timeout_secs, 42);
        // A prefix of its own keeps this test off other tests' environment.
        std::env::set_var("FT_CFGTEST_DIST__TIMEOUT_SECS", "7");
        let env = Env::prefixed("FT_CFGTEST_").split("__");
        assert_eq!(Config::load_with_env(Some(&path), &[], env).unwrap().dist.timeout_secs, 7);
    }

    #[test]
    fn yaml_and_json_files() {
        let (_d1, yaml) = file("ft.yaml", "dist:\n  timeout_secs: 5\n");
        assert_eq!(Config::load_with_env(Some(&yaml), &[], no_env()).unwrap().dist.timeout_secs, 5);
        let (_d2, json) = file("ft.json", r#"{"dist": {"backend": "nccl"}}"#);
        assert_eq!(Config::load_with_env(Some(&json), &[], no_env()).unwrap().dist.backend, Backend::Nccl);
    }

    #[test]
    fn unknown_keys_are_named_with_a_suggestion() {
        let (_dir, path) = file("ft.toml", "[dist]\ntimout_secs = 10\n");
        let err = Config::load_with_env(Some(&path), &[], no_env()).unwrap_err().to_string();
        assert!(err.contains("unknown config key `dist.timout_secs` in TOML file"), "{err}");
        assert!(err.contains("did you mean `timeout_secs`?"), "{err}");
        assert!(err.contains("ft.toml"), "{err}");
    }

    #[test]
    fn bad_values_and_files_are_rejected() {
        let (_dir, path) = file("ft.toml", "[dist]\nbackend = 'mpi'\n");
        let err = Config::load_with_env(Some(&path), &[], no_env()).unwrap_err().to_string();
        assert!(err.contains("dist.backend"), "{err}");
        let err = Config::load_with_env(Some(Path::new("/nonexistent/ft.toml")), &[], no_env()).unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");
        let (_d, ini) = file("ft.ini", "");
        let err = Config::load_with_env(Some(&ini), &[], no_env()).unwrap_err();
        assert!(err.to_string().contains("must end in .toml"), "{err}");
    }
}
