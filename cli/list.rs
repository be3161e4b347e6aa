//! `ft list`: what the registry holds.

use ft_core::Registry;

pub fn run(registry: &Registry) {
    println!("models (config.json model_type):");
    for m in registry.models() {
        println!("  {:<16} {}", m.model_type, m.summary);
    }
    println!("tasks (--task; the default is the one for the model's head):");
    for t in registry.tasks() {
        println!("  {:<16} {} [head: {}]", t.name, t.summary, t.head_kind);
    }
    println!("strategies:");
    if registry.strategies().is_empty() {
        println!("  (none registered)");
    }
    for s in registry.strategies() {
        let aliases = if s.aliases.is_empty() { String::new() } else { format!(" (alias {})", s.aliases.join(", ")) };
        println!("  {:<16} {}{aliases} [{}]", s.name, s.summary, s.origin);
    }
    println!("communication (--comm; options as --set comm.NAME.KEY=VALUE):");
    for c in registry.comms() {
        println!("  {:<16} {} [{}]", c.name, c.summary, c.origin);
        for option in &c.options {
            println!("  {:<18} {} = {:<8} {}", "", option.key, option.default, option.help);
        }
    }
    println!("offload (--offload):");
    for o in registry.offloads() {
        println!("  {:<16} {} [built-in]", o.name, o.summary);
    }
    println!("metrics sinks:");
    for s in registry.sinks() {
        println!("  {:<16} {} [{}]", s.name, s.summary, s.origin);
    }
    println!("presets (--model NAME):");
    for p in registry.presets() {
        println!("  {:<16} {}{}", p.name, p.summary, if p.default { " [default]" } else { "" });
    }
}
