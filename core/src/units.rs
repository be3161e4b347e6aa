//! Quantities as users write them on a command line: memory sizes with
//! their unit (`80GB`, `80GiB`), positive rates (`2e10`) and ranges of
//! optimizer steps (`10:12`).

/// A memory size with its unit, in bytes: 80GB (10^9 bytes each), 80GiB (2^30), also KB/MB/TB and KiB/MiB/TiB.
pub fn parse_size(text: &str) -> Result<f64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale = match unit.trim().to_ascii_uppercase().as_str() {
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KIB" => 1024.0,
        "MIB" => 1024.0f64.powi(2),
        "GIB" => 1024.0f64.powi(3),
        "TIB" => 1024.0f64.powi(4),
        _ => return Err(format!("{text:?}: give a size with its unit, e.g. 80GB or 80GiB")),
    };
    let number: f64 = number.parse().map_err(|_| format!("{text:?}: expected a number and a unit, e.g. 80GB"))?;
    positive(text, number * scale)
}

/// A number above 0 (a rate or a bandwidth).
pub fn parse_positive(text: &str) -> Result<f64, String> {
    positive(text, text.trim().parse().map_err(|_| format!("{text:?}: expected a number"))?)
}

/// Optimizer steps FIRST:LAST, both counted from 1 (`--profile-steps 10:12`).
pub fn parse_step_range(text: &str) -> Result<[usize; 2], String> {
    let parse = |part: Option<&str>| part.and_then(|p| p.trim().parse::<usize>().ok());
    let mut parts = text.splitn(2, ':');
    match (parse(parts.next()), parse(parts.next())) {
        (Some(first), Some(last)) => Ok([first, last]),
        _ => Err(format!("{text:?} is not FIRST:LAST, e.g. 10:12")),
    }
}

fn positive(text: &str, value: f64) -> Result<f64, String> {
    if value > 0.0 && value.is_finite() {
        Ok(value)
    } else {
        Err(format!("{text:?}: expected more than 0"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_their_unit_and_rates_must_be_positive() {
        assert_eq!(parse_size("80GB"), Ok(80e9));
        assert_eq!(parse_size(" 1.5 GiB"), Ok(1.5 * 1024f64.powi(3)));
        assert!(parse_size("80").unwrap_err().contains("give a size with its unit"));
        assert!(parse_size("0GB").unwrap_err().contains("expected more than 0"));
        assert_eq!(parse_positive("2e10"), Ok(2e10));
        assert!(parse_positive("-1").is_err() && parse_positive("inf").is_err());
    }
}
