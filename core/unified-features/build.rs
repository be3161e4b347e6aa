// cargo considers build-dependencies (the unified features of build-time crates) only for a package with a build script.
fn main() {}
