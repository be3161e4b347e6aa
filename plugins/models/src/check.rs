//! The checks every architecture runs on its config.json before it builds
//! anything: a number that does not fit would otherwise surface as a panic
//! deep inside libtorch (a `view` of 64 features as 3 heads), or as an
//! allocation the size of the universe. Each refusal names the key, its
//! value and the rule; `hf` adds the file.

use anyhow::{bail, Result};
use ft_core::model::UnitSpec;

/// Layers beyond any real model (the largest have ~130): a bound that keeps
/// a corrupt count from building billions of units.
const MAX_LAYERS: i64 = 4096;

/// Sizes beyond any real model's (vocabularies reach ~2^18, position tables
/// ~2^24): products of two such sizes still fit in an i64.
const MAX_SIZE: i64 = 1 << 31;

/// Parameters beyond any model a machine holds (~2.8·10^14).
const MAX_PARAMETERS: i64 = 1 << 48;

/// Reads an architecture's config struct from config.json's JSON; a value
/// of the wrong type is named by its key (serde alone names only the type).
pub(crate) fn parse<T: serde::de::DeserializeOwned>(config: &serde_json::Value) -> Result<T> {
    serde_path_to_error::deserialize(config).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        // At the top level (a missing key) serde's message already names the key.
        if path == "." {
            anyhow::anyhow!("{inner}")
        } else {
            anyhow::anyhow!("{path}: {inner}")
        }
    })
}

/// Each size is at least 1 and at most [`MAX_SIZE`].
pub(crate) fn sizes(sizes: &[(&str, i64)]) -> Result<()> {
    for &(key, value) in sizes {
        if value < 1 {
            bail!("{key} must be at least 1, not {value}");
        }
        if value > MAX_SIZE {
            bail!("{key} ({value}) must be at most {MAX_SIZE}");
        }
    }
    Ok(())
}

/// A layer count: at least 1 and at most [`MAX_LAYERS`].
pub(crate) fn layers(key: &str, value: i64) -> Result<()> {
    if !(1..=MAX_LAYERS).contains(&value) {
        bail!("{key} must be between 1 and {MAX_LAYERS}, not {value}");
    }
    Ok(())
}

/// `value` is a multiple of `divisor` (both already checked positive).
pub(crate) fn multiple_of((key, value): (&str, i64), (divisor_key, divisor): (&str, i64)) -> Result<()> {
    if value % divisor != 0 {
        bail!("{key} ({value}) must be a multiple of {divisor_key} ({divisor})");
    }
    Ok(())
}

/// An epsilon, a base, a scale factor: positive and finite.
pub(crate) fn positive(key: &str, value: f64) -> Result<()> {
    if !(value > 0.0 && value.is_finite()) {
        bail!("{key} must be a positive finite number, not {value}");
    }
    Ok(())
}

/// A standard deviation (of the initialisation): finite and not negative.
pub(crate) fn std(key: &str, value: f64) -> Result<()> {
    if !(value >= 0.0 && value.is_finite()) {
        bail!("{key} must be a finite number of at least 0, not {value}");
    }
    Ok(())
}

/// Dropout probabilities: each in [0, 1].
pub(crate) fn probabilities(probabilities: &[(&str, f64)]) -> Result<()> {
    for &(key, p) in probabilities {
        if !(0.0..=1.0).contains(&p) {
            bail!("{key} must lie in [0, 1], not {p}");
        }
    }
    Ok(())
}

/// `units` declare at most [`MAX_PARAMETERS`], counted without overflow:
/// sizes that pass one by one can still multiply past anything a machine
/// holds (and past an i64, where counting them would panic).
pub(crate) fn parameters(units: &[UnitSpec]) -> Result<()> {
    let count = units
        .iter()
        .flat_map(|unit| &unit.params)
        .try_fold(0i64, |total, spec| spec.shape.iter().try_fold(1i64, |n, &d| n.checked_mul(d))?.checked_add(total));
    if count.is_none_or(|count| count > MAX_PARAMETERS) {
        bail!("the sizes make more than {MAX_PARAMETERS} parameters, more than any machine holds");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ft_core::model::{Init, ParamSpec};

    #[test]
    fn refusals_name_the_key_the_value_and_the_rule() {
        let message = |result: Result<()>| result.unwrap_err().to_string();
        assert_eq!(message(multiple_of(("hidden_size", 64), ("n_head", 3))), "hidden_size (64) must be a multiple of n_head (3)");
        assert_eq!(message(sizes(&[("vocab_size", 64), ("ffn_dim", 0)])), "ffn_dim must be at least 1, not 0");
        assert_eq!(message(sizes(&[("vocab_size", 1 << 40)])), "vocab_size (1099511627776) must be at most 2147483648");
        assert_eq!(message(layers("n_layer", 0)), "n_layer must be between 1 and 4096, not 0");
        assert_eq!(message(positive("rms_norm_eps", -1e-6)), "rms_norm_eps must be a positive finite number, not -0.000001");
        assert_eq!(message(std("init_std", -0.02)), "init_std must be a finite number of at least 0, not -0.02");
        assert_eq!(message(probabilities(&[("dropout", 1.5)])), "dropout must lie in [0, 1], not 1.5");
        assert!(positive("eps", f64::INFINITY).is_err() && std("std", f64::NAN).is_err() && probabilities(&[("p", f64::NAN)]).is_err());
    }

    #[test]
    fn wrong_types_are_named_by_key() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Config {
            hidden_size: i64,
            rope: Option<Rope>,
        }
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Rope {
            factor: f64,
        }
        let message = |json: serde_json::Value| parse::<Config>(&json).unwrap_err().to_string();
        assert_eq!(message(serde_json::json!({"hidden_size": "64"})), "hidden_size: invalid type: string \"64\", expected i64");
        assert_eq!(message(serde_json::json!({"hidden_size": 64.5})), "hidden_size: invalid type: floating point `64.5`, expected i64");
        assert_eq!(message(serde_json::json!({})), "missing field `hidden_size`");
        let nested = message(serde_json::json!({"hidden_size": 64, "rope": {"factor": null}}));
        assert_eq!(nested, "rope.factor: invalid type: null, expected f64");
    }

    #[test]
    fn parameter_counts_are_bounded_and_never_overflow() {
        let unit = |shape: &[i64]| UnitSpec { name: "u".into(), params: vec![ParamSpec::new("", "w", shape, Init::Zeros)] };
        assert!(parameters(&[unit(&[1 << 24, 1 << 23]), unit(&[1 << 47])]).is_ok());
        let message = parameters(&[unit(&[1 << 24, 1 << 23]), unit(&[1 << 47]), unit(&[1])]).unwrap_err().to_string();
        assert_eq!(message, "the sizes make more than 281474976710656 parameters, more than any machine holds");
        assert!(parameters(&[unit(&[MAX_SIZE, MAX_SIZE]), unit(&[MAX_SIZE, MAX_SIZE])]).is_err());
        assert!(parameters(&[unit(&[i64::MAX, 2])]).is_err());
    }
}
