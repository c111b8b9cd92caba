//! naga's SPIR-V of a kernel, as wgpu would write it for Vulkan: the capabilities it declares.

use hesper_dsl::Kernel;
use hesper_dsl::validate::{capabilities, validate_wgsl};

pub const COOPERATIVE_MATRIX_KHR: u32 = 6022;
pub const VULKAN_MEMORY_MODEL: u32 = 5345;

/// Every `OpCapability` of the kernel's SPIR-V.
pub fn capabilities_of(kernel: &Kernel) -> Vec<u32> {
    let caps = capabilities(kernel);
    let module = validate_wgsl(kernel.wgsl(), caps).unwrap();
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
        .validate(&module)
        .unwrap();
    let options = naga::back::spv::Options {
        lang_version: (1, 3),
        ..Default::default()
    };
    let words = naga::back::spv::write_vec(&module, &info, &options, None).unwrap();
    // OpCapability is opcode 17, two words long.
    words
        .windows(2)
        .filter(|w| w[0] == (2 << 16) | 17)
        .map(|w| w[1])
        .collect()
}

/// Whether it declares what cooperative matrices need.
pub fn has_coop_capabilities(kernel: &Kernel) -> bool {
    let caps = capabilities_of(kernel);
    caps.contains(&COOPERATIVE_MATRIX_KHR) && caps.contains(&VULKAN_MEMORY_MODEL)
}
