//! naga's parse and validation of emitted WGSL. The device limits naga does not check
//! (workgroup memory, invocations, immediates) are in [`Kernel::check_limits`](crate::Kernel::check_limits).

use naga::valid::{Capabilities, ValidationFlags, Validator};

use crate::kernel::Kernel;

/// The naga capabilities a kernel's WGSL needs.
pub fn capabilities(kernel: &Kernel) -> Capabilities {
    let mut caps = Capabilities::empty();
    if kernel.uses_subgroups() {
        caps |= Capabilities::SUBGROUP;
    }
    if kernel.uses_f16() {
        caps |= Capabilities::SHADER_FLOAT16;
    }
    if kernel.uses_cooperative_matrix() {
        caps |= Capabilities::COOPERATIVE_MATRIX;
    }
    if kernel.params_as_immediates() && !kernel.params().is_empty() {
        caps |= Capabilities::IMMEDIATES;
    }
    caps
}

/// Parse and validate WGSL text with naga, as wgpu will; `Err` holds naga's report.
pub fn validate_wgsl(wgsl: &str, capabilities: Capabilities) -> Result<naga::Module, String> {
    let module = naga::front::wgsl::parse_str(wgsl).map_err(|e| e.emit_to_string(wgsl))?;
    Validator::new(ValidationFlags::all(), capabilities)
        .validate(&module)
        .map_err(|e| e.emit_to_string(wgsl))?;
    Ok(module)
}

pub(crate) fn validate(kernel: &Kernel) -> Result<(), String> {
    validate_wgsl(kernel.wgsl(), capabilities(kernel)).map(|_| ())
}
