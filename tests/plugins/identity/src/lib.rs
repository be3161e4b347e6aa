//! Test fixture: `identity`, a communication plug-in that wraps the
//! built-in collectives (so a run through it must equal the built-in bit
//! for bit), and — with `comm.identity.fault` — breaks the contract the way
//! `ft plugin check` must catch: `sizes` (rank 1 all-reduces one element
//! more than the others), `error` (a reduction returns an error), `panic`,
//! `drift` (1e-3 added to every gradient element this rank sends: losses
//! off the built-in's once the learning rate is above 0, yet deterministic, so a resume
//! still equals its own uninterrupted run), `rows` (its all-to-all sends each
//! rank's rows in reverse order: the right sizes, the wrong values).

use anyhow::{bail, Result};
use ft_core::comm_hook::{option, Builtin, CommHook, CommOption, GradReduce, ParamGather, Pending, TokenExchange};
use ft_core::plugin::PluginRegistrar;
use ft_core::Reduction;
use tch::Tensor;

struct Identity {
    fault: String,
}

impl CommHook for Identity {
    fn name(&self) -> &str {
        "identity"
    }

    fn reduce(&mut self, mut request: GradReduce) -> Result<Pending> {
        match self.fault.as_str() {
            "error" if request.step >= 1 => bail!("the identity fixture fails on purpose at step {}", request.step),
            "panic" if request.step >= 1 => panic!("the identity fixture panics on purpose at step {}", request.step),
            "sizes" if request.step >= 1 && request.group.rank() == 1 => {
                let mut wrong = Tensor::zeros([request.input.size()[0] + 1], (request.input.kind(), request.input.device()));
                Ok(Pending::of(request.group.all_reduce(&mut wrong, Reduction::Sum)?))
            }
            "drift" => {
                let _ = request.input.f_add_scalar_(1e-3)?;
                Builtin.reduce(request)
            }
            _ => Builtin.reduce(request),
        }
    }

    fn gather(&mut self, request: ParamGather) -> Result<Pending> {
        Builtin.gather(request)
    }

    fn all_to_all(&mut self, request: TokenExchange) -> Result<Pending> {
        match self.fault.as_str() {
            "rows" => Builtin.all_to_all(TokenExchange { input: request.input.flip([0]), ..request }),
            _ => Builtin.all_to_all(request),
        }
    }
}

fn register(registrar: &mut PluginRegistrar) {
    const OPTIONS: &[CommOption] = &[CommOption { key: "fault", default: "none", help: "none, sizes, error, panic, drift or rows" }];
    registrar.add_comm("identity", "the built-in collectives, wrapped (a test fixture)", OPTIONS, |options| {
        Ok(Box::new(Identity { fault: option("identity", options, "fault", "none".to_string())? }))
    });
}

ft_core::export_plugin!(register);
