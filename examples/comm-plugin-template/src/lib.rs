//! A communication plug-in to start from: `template` reduces and gathers
//! with the built-in collectives and counts what it is asked to do, which
//! is where your behaviour goes (docs/PLUGINS.md walks through a real one,
//! `plugins/comm/powersgd`). Build with `./build.sh` (add `--release` for
//! the build you deploy), check with `ft plugin check
//! target/debug/libtemplate.so`, run with `ft --plugin
//! target/debug/libtemplate.so train --comm template`.

use anyhow::Result;
use ft_core::comm_hook::{option, Builtin, CommHook, CommOption, GradReduce, ParamGather, Pending, Restored};
use ft_core::plugin::PluginRegistrar;
use tch::{Kind, Tensor};

struct Template {
    /// Requests served so far (state: checkpointed and restored on resume).
    served: i64,
    /// An option, read from `--set comm.template.log_every=N`.
    log_every: i64,
}

impl CommHook for Template {
    fn name(&self) -> &str {
        "template"
    }

    fn reduce(&mut self, request: GradReduce) -> Result<Pending> {
        self.served += 1;
        if self.log_every > 0 && self.served % self.log_every == 0 {
            eprintln!("template: {} requests, now {} of unit {}", self.served, request.stage.name(), request.unit.name);
        }
        // Change what goes over the wire here; the sum over the group must land in `request.output`.
        Builtin.reduce(request)
    }

    fn gather(&mut self, request: ParamGather) -> Result<Pending> {
        Builtin.gather(request)
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        vec![("served".into(), Tensor::from_slice(&[self.served as f32]))]
    }

    /// Says what it kept: the log repeats it, and a state it cannot use is `Restored::Afresh`.
    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<Restored> {
        match state.iter().find(|(name, _)| name == "served") {
            Some((_, tensor)) => {
                self.served = tensor.to_kind(Kind::Double).double_value(&[0]) as i64;
                Ok(Restored::Kept(format!("the count of requests served ({})", self.served)))
            }
            None => Ok(Restored::Afresh),
        }
    }
}

fn register(registrar: &mut PluginRegistrar) {
    const OPTIONS: &[CommOption] = &[CommOption { key: "log_every", default: "0", help: "print a line every N requests (0: never)" }];
    registrar.add_comm("template", "the built-in collectives, counted: a plug-in to start from", OPTIONS, |options| {
        Ok(Box::new(Template { served: 0, log_every: option("template", options, "log_every", 0)? }))
    });
}

ft_core::export_plugin!(register);
