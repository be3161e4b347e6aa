//! Everything that spans ranks: the communicator over c10d (`comm`) and
//! shared memory between the ranks of one host (`shm`), the
//! communication hooks that carry its requests (`comm_hook`), the sharding
//! policies (`strategy`) and the process groups they need (`parallel`), the
//! flat buffers a policy places (`flat`, `packed_base`, `float8_gather`),
//! expert parallelism's groups and token exchanges (`experts`),
//! starting local ranks (`launch`) and `ft comm-test` (`collectives_bench`).

pub mod collectives_bench;
pub mod comm;
pub mod comm_hook;
pub mod experts;
pub mod flat;
pub mod float8_gather;
pub mod launch;
pub mod packed_base;
pub mod parallel;
mod shm;
pub mod strategy;
