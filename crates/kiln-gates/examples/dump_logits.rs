//! Parity helper for `scripts/hf-parity.py`: kiln's logits for a synthetic-corpus text on a
//! run's (or checkpoint's) weights, as the JSON the script compares an export against.
//! Usage: dump_logits RUN_DIR|CHECKPOINT TEXT OUT.json

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, source, text, out] = args.as_slice() else {
        return Err("usage: dump_logits RUN_DIR|CHECKPOINT TEXT OUT.json".into());
    };
    let loaded = kiln_gates::mc::load_model(std::path::Path::new(source), None)?;
    let v = kiln_gates::export::reference_logits(&loaded.session, text)?;
    std::fs::write(out, v.to_string())?;
    Ok(())
}
