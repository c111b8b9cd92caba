//! The kernel catalog: every entry builds at its defaults, which are the shapes of the modules'
//! `kernels()`; every kernel of those lists comes back from its entry given its key's values;
//! overrides reach the WGSL; every error names the kernel and the item at fault; no value a
//! user may type makes a builder panic. No GPU: building a kernel validates it with naga.

use std::panic::{AssertUnwindSafe, catch_unwind};

use hesper_dsl::{Features, Kernel, KernelKey, Limits};
use hesper_kernels::catalog::{self, CatalogError, Entry, Kind};
use hesper_kernels::{argmax, attention, elementwise, ffn, linear, lora, loss, norm, optim, rope};

/// Every module's `kernels()`, in order.
fn all_kernels() -> Vec<Kernel> {
    let lists = [
        argmax::kernels,
        attention::kernels,
        elementwise::kernels,
        ffn::kernels,
        linear::kernels,
        lora::kernels,
        loss::kernels,
        norm::kernels,
        optim::kernels,
        rope::kernels,
    ];
    lists.iter().flat_map(|list| list().unwrap()).collect()
}

fn shape(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn build(name: &str, pairs: &[(&str, &str)]) -> Result<Kernel, CatalogError> {
    catalog::find(name).unwrap().build(&shape(pairs))
}

/// The error of a build that must fail, and its message.
fn error(name: &str, pairs: &[(&str, &str)]) -> (CatalogError, String) {
    let err = build(name, pairs).expect_err("the build must fail");
    let message = err.to_string();
    (err, message)
}

#[test]
fn entries_are_sorted_by_module_then_name_with_unique_names() {
    let entries = catalog::entries();
    assert_eq!(entries.len(), 56);
    for pair in entries.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(
            (a.module, a.name) < (b.module, b.name),
            "{}::{} before {}::{}",
            a.module,
            a.name,
            b.module,
            b.name
        );
    }
    let mut names: Vec<&str> = entries.iter().map(|e| e.name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), entries.len(), "a name twice");
    for e in entries {
        assert!(!e.summary.is_empty(), "{}", e.name);
        let mut params: Vec<&str> = e.params.iter().map(|p| p.name).collect();
        params.sort();
        params.dedup();
        assert_eq!(
            params.len(),
            e.params.len(),
            "{}: a parameter twice",
            e.name
        );
        assert!(e.params.iter().all(|p| !p.doc.is_empty()), "{}", e.name);
    }
}

#[test]
fn every_entry_builds_at_its_defaults_under_its_name() {
    for e in catalog::entries() {
        let kernel = e
            .build(&[])
            .unwrap_or_else(|err| panic!("{}: {err}", e.name));
        assert_eq!(kernel.name(), e.name);
        assert!(kernel.wgsl().contains("fn main("), "{}", e.name);
        assert!(std::ptr::eq(catalog::find(e.name).unwrap(), e));
    }
}

/// With no override an entry is the first kernel of its name in its module's `kernels()`, and
/// every entry has one there.
#[test]
fn defaults_reproduce_the_first_kernel_of_each_name_in_kernels() {
    let kernels = all_kernels();
    for e in catalog::entries() {
        let Some(first) = kernels.iter().find(|k| k.name() == e.name) else {
            panic!("no kernel `{}` in any module's kernels()", e.name);
        };
        let built = e.build(&[]).unwrap();
        assert_eq!(built.key(), first.key(), "{}", e.name);
        assert_eq!(built.wgsl(), first.wgsl(), "{}", e.name);
    }
}

/// The catalog's value of each parameter of `entry` for `key`: the key's shape of its name, or
/// the part of the key it stands for.
fn values_of(entry: &Entry, key: &KernelKey) -> Vec<(String, String)> {
    let shape = |name: &str| {
        key.get(name)
            .unwrap_or_else(|| panic!("{key}: no shape `{name}` for `{}`", entry.name))
            .to_string()
    };
    let workgroup = key.wg_size()[0].to_string();
    entry
        .params
        .iter()
        .map(|p| {
            let value = match p.name {
                "subgroups" => key.feature_set().contains(Features::SUBGROUPS).to_string(),
                "tile" if key.get("wm").is_some() => format!(
                    "{}x{}x{}_{}x{}",
                    shape("bm"),
                    shape("bn"),
                    shape("bk"),
                    shape("wm"),
                    shape("wn")
                ),
                // The tiled GEMM's key holds its f16 flags only when they are set.
                "input_f16" | "weight_f16" | "output_f16" if key.get(p.name).is_none() => {
                    "false".into()
                }
                "tile" if key.get("bm").is_some() => format!(
                    "{}x{}x{}_{}x{}",
                    shape("bm"),
                    shape("bn"),
                    shape("bk"),
                    shape("tm"),
                    shape("tn")
                ),
                "tile" => format!("{}x{}x{}", shape("block"), shape("bk"), shape("vk")),
                "invocations" => workgroup.clone(),
                "wg" if key.get("wg").is_none() => workgroup.clone(),
                name => shape(name),
            };
            (p.name.to_string(), value)
        })
        .collect()
}

/// Every kernel of every module's `kernels()`, built from its entry with its key's values: the
/// same key, byte-identical WGSL.
#[test]
fn every_kernel_of_kernels_comes_back_from_its_entry_given_its_key() {
    let kernels = all_kernels();
    assert!(kernels.len() >= catalog::entries().len());
    for k in &kernels {
        let entry = catalog::find(k.name()).unwrap_or_else(|e| panic!("{}: {e}", k.key()));
        let values = values_of(entry, k.key());
        let built = entry
            .build(&values)
            .unwrap_or_else(|e| panic!("{}: {e}", k.key()));
        assert_eq!(built.key(), k.key(), "{values:?}");
        assert_eq!(built.wgsl(), k.wgsl(), "{}", k.key());
    }
}

#[test]
fn a_width_override_shows_in_the_wgsl_as_a_constant() {
    let default = build("rms_norm_forward", &[]).unwrap();
    let wide = build("rms_norm_forward", &[("cols", "1000")]).unwrap();
    assert!(default.wgsl().contains("const cols: u32 = 2560u;"));
    assert!(
        wide.wgsl().contains("const cols: u32 = 1000u;"),
        "{}",
        wide.wgsl()
    );
    assert!(
        wide.wgsl().contains("row * 250u"),
        "vec4s: 1000 columns are 250"
    );
    assert!(!wide.wgsl().contains("2560"));
    assert_eq!(wide.key().get("cols"), Some(1000u32.into()));

    let gemm = build("matmul_nt", &[("cols", "1000"), ("tile", "medium")]).unwrap();
    assert_eq!(gemm.key().wg_size(), [64, 1, 1]);
    assert!(gemm.wgsl().contains("const cols: u32 = 1000u;"));
    assert!(gemm.wgsl().contains("@workgroup_size(64)"));
    // A standard tensor-core tile by name: `wide12`, twelve subgroups of 32, within the
    // 48 KiB of workgroup memory NVIDIA's Vulkan driver grants (not WebGPU's default 32).
    let nvidia = hesper_dsl::Limits {
        max_workgroup_storage_bytes: 48 * 1024,
        ..hesper_dsl::Limits::default()
    };
    let coop = catalog::find("coop_matmul_nt").unwrap().build_with_limits(
        &shape(&[("cols", "576"), ("depth", "576"), ("tile", "wide12")]),
        &nvidia,
    );
    assert_eq!(coop.unwrap().key().wg_size(), [384, 1, 1]);

    let eps = build("rms_norm_forward", &[("eps", "1e-5")]).unwrap();
    assert!(
        eps.wgsl().contains("const eps: f32 = 1e-5f;"),
        "{}",
        eps.wgsl()
    );

    let scalar = build("embedding", &[("dim", "5")]).unwrap();
    assert!(
        scalar
            .wgsl()
            .contains("var<storage, read> table: array<f32>;")
    );
    let wide = build("embedding", &[("dim", "64")]).unwrap();
    assert!(
        wide.wgsl()
            .contains("var<storage, read> table: array<vec4<f32>>;")
    );
}

/// `tau = auto` is 1/√hd at the head dimension given, as the executor forms it.
#[test]
fn tau_auto_follows_the_head_dimension() {
    let auto = build("score_backward_q", &[("head_dim", "64")]).unwrap();
    let given = build("score_backward_q", &[("head_dim", "64"), ("tau", "0.125")]).unwrap();
    assert_eq!(auto.wgsl(), given.wgsl());
    let other = build("score_backward_q", &[("head_dim", "64"), ("tau", "0.5")]).unwrap();
    assert_ne!(auto.wgsl(), other.wgsl());
    assert_eq!(other.key().get("tau"), Some(0.5f32.into()));
}

/// Values other than the default for a parameter: some must build, and give another key.
fn alternatives(kind: Kind, name: &str, default: &str) -> Vec<String> {
    match (kind, name) {
        (Kind::U32, _) => {
            let d: u32 = default.parse().unwrap();
            [d * 2, d + 4, d / 2, d + 1, d.saturating_sub(1)]
                .iter()
                .filter(|v| **v != d)
                .map(u32::to_string)
                .collect()
        }
        (Kind::F32, _) => vec!["0.5".into()],
        (Kind::Bool, _) => vec![(default == "false").to_string()],
        (Kind::Text(_), "tau") => vec!["0.5".into()],
        (Kind::Text(_), "tile") => ["medium", "portable", "32x32x8_4x4", "32x16x8"]
            .map(String::from)
            .to_vec(),
        (Kind::Text(_), other) => panic!("no alternatives for `{other}`"),
    }
}

/// Every parameter is part of the key: some other value of it builds a kernel of another key.
#[test]
fn every_parameter_changes_the_key() {
    for e in catalog::entries() {
        let default = e.build(&[]).unwrap();
        for p in e.params {
            // A split GEMM has an f32 output, does not accumulate (its parts' sum does) and
            // cuts its depth into whole steps: other values of `splits` come with those.
            let with = |v: String| match p.name {
                "splits" => shape(&[
                    ("splits", &v),
                    ("accumulate", "false"),
                    ("output_f16", "false"),
                    ("depth", "256"),
                ]),
                // A second input comes with a second weight.
                "second_n" => shape(&[("second_n", &v), ("pair", "true")]),
                _ => vec![(p.name.to_string(), v)],
            };
            let changed = alternatives(p.kind, p.name, p.default)
                .into_iter()
                .filter_map(|v| e.build(&with(v)).ok())
                .any(|k| k.key() != default.key() && k.wgsl() != default.wgsl());
            assert!(
                changed,
                "{}: no other value of `{}` builds another kernel",
                e.name, p.name
            );
        }
    }
}

#[test]
fn an_unknown_kernel_names_the_close_names_or_all() {
    let err = catalog::find("rms_norm").unwrap_err();
    let CatalogError::UnknownKernel { name, close } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(name, "rms_norm");
    assert_eq!(
        close,
        &[
            "rms_norm_backward",
            "rms_norm_dgamma_partials",
            "rms_norm_dgamma_sum",
            "rms_norm_forward"
        ]
    );
    assert_eq!(
        err.to_string(),
        "no kernel `rms_norm` in the catalog; close names: rms_norm_backward, \
         rms_norm_dgamma_partials, rms_norm_dgamma_sum, rms_norm_forward"
    );
    // A typo: a few edits away.
    let message = catalog::find("matmul_tn").unwrap_err().to_string();
    assert!(
        message.contains("close names: matmul_nn, matmul_nt"),
        "{message}"
    );
    let message = catalog::find("Swiglu_Forwrd").unwrap_err().to_string();
    assert!(message.contains("close names: swiglu_forward"), "{message}");
    // Nothing like it: every name.
    let message = catalog::find("conv2d_winograd").unwrap_err().to_string();
    assert!(
        message.starts_with("no kernel `conv2d_winograd` in the catalog; its kernels are: "),
        "{message}"
    );
    for e in catalog::entries() {
        assert!(message.contains(e.name), "{message}");
    }
}

#[test]
fn an_unknown_parameter_names_the_kernel_the_parameter_and_those_it_has() {
    let (err, message) = error("rms_norm_forward", &[("colls", "576")]);
    assert!(matches!(err, CatalogError::UnknownParam { .. }), "{err:?}");
    assert_eq!(
        message,
        "kernel `rms_norm_forward` has no shape parameter `colls`; its parameters are: cols, eps, subgroups"
    );
    let (_, message) = error("add", &[("n", "4")]);
    assert_eq!(
        message,
        "kernel `add` has no shape parameter `n`; it has none"
    );
    let (_, message) = error("rope", &[("half", "32"), ("half", "64")]);
    assert_eq!(
        message,
        "kernel `rope`, shape parameter `half`: given twice (`32`, then `64`)"
    );
}

#[test]
fn a_value_that_does_not_parse_names_the_kernel_the_parameter_the_kind_and_the_value() {
    let cases: &[(&str, (&str, &str), &str)] = &[
        ("rms_norm_forward", ("cols", "wide"), "a u32"),
        ("rms_norm_forward", ("cols", "-4"), "a u32"),
        ("rms_norm_forward", ("cols", "4294967296"), "a u32"),
        ("rms_norm_forward", ("eps", "tiny"), "a finite f32"),
        ("rms_norm_forward", ("eps", "inf"), "a finite f32"),
        ("rms_norm_backward", ("accumulate", "yes"), "true or false"),
        ("rms_norm_backward", ("subgroups", "1"), "true or false"),
        (
            "decode_attention",
            ("tau", "NaN"),
            "an f32, or `auto` for 1/√head_dim",
        ),
        (
            "matmul_nt",
            ("tile", "64x64x16"),
            "a tile BMxBNxBK_TMxTN (e.g. 64x64x16_8x8), or large, medium, small or portable",
        ),
        (
            "matmul_nt",
            ("tile", "huge"),
            "a tile BMxBNxBK_TMxTN (e.g. 64x64x16_8x8), or large, medium, small or portable",
        ),
        (
            "attention_forward",
            ("tile", "64x16"),
            "a tile BLOCKxBKxVK (e.g. 64x16x32), or large, medium or portable",
        ),
    ];
    for &(kernel, (param, value), expected) in cases {
        let (err, message) = error(kernel, &[(param, value)]);
        assert_eq!(
            err,
            CatalogError::Value {
                kernel: kernel.into(),
                param: param.into(),
                expected: expected.into(),
                given: value.into(),
            }
        );
        assert_eq!(
            message,
            format!(
                "kernel `{kernel}`, shape parameter `{param}`: expected {expected}, given `{value}`"
            )
        );
    }
}

/// Shapes the executor would refuse: the kernel, the value and the rule.
#[test]
fn a_shape_the_kernel_does_not_take_names_the_rule() {
    let (err, message) = error("matmul_nn", &[("tile", "16x16x4_3x3")]);
    assert!(matches!(err, CatalogError::Rule { .. }), "{err:?}");
    assert!(
        message.starts_with("kernel `matmul_nn`: cannot build tile Tile { bm: 16, bn: 16, bk: 4, tm: 3, tn: 3 }: tm and tn must be multiples of 4"),
        "{message}"
    );
    let (_, message) = error("lora_down", &[("rank", "40")]);
    assert_eq!(
        message,
        "kernel `lora_down`: cannot build rank = 40: the rank must be 1 to 32 (larger ranks go \
         through the GEMM)"
    );
    let (_, message) = error("lora_down", &[("column_lanes", "60")]);
    assert!(
        message.contains("column_lanes must be a positive multiple of 8"),
        "{message}"
    );
    let (_, message) = error("lora_down_subgroups", &[("lanes", "48")]);
    assert!(
        message.starts_with("kernel `lora_down_subgroups`: cannot build lanes = 48: "),
        "{message}"
    );
    let (_, message) = error("attention_forward", &[("heads", "8")]);
    assert_eq!(
        message,
        "kernel `attention_forward`: cannot build heads = 8, kv_heads = 3: heads must be a \
         positive multiple of kv_heads (GQA)"
    );
    let (_, message) = error("attention_backward_stats", &[("head_dim", "130")]);
    assert!(
        message.contains("head_dim must be a positive multiple of 4"),
        "{message}"
    );
    let (_, message) = error("decode_attention", &[("head_dim", "256")]);
    assert!(
        message.starts_with("kernel `decode_attention`: cannot build head_dim = 256: "),
        "{message}"
    );
}

/// A kernel over the device limits it is built for: the DSL's error, with the shape; within
/// larger limits the same shape builds.
#[test]
fn a_kernel_the_dsl_rejects_names_the_shape_and_larger_limits_take_it() {
    let entry = catalog::find("attention_forward").unwrap();
    let wide = shape(&[("head_dim", "128")]);
    let err = entry.build(&wide).unwrap_err();
    let CatalogError::Build { kernel, error, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(kernel, "attention_forward");
    assert_eq!(error.kernel, "attention_forward");
    assert_eq!(
        err.to_string(),
        "building attention_forward at head_dim=128 heads=9 kv_heads=3 padded=true tile=large: \
         kernel `attention_forward`: workgroup memory of 49152 bytes is over the limit of 32768 \
         bytes"
    );
    assert!(std::error::Error::source(&err).is_some());
    let h200 = Limits {
        max_workgroup_storage_bytes: 48 * 1024,
        ..Limits::default()
    };
    let kernel = entry.build_with_limits(&wide, &h200).unwrap();
    assert_eq!(kernel.workgroup_memory_bytes(), 49152);
    // The medium tile fits the default limits.
    let medium = shape(&[("head_dim", "128"), ("tile", "medium")]);
    entry.build(&medium).unwrap();
}

/// Numbers a user may type, at every numeric parameter of every entry: a kernel or an error,
/// never a panic.
#[test]
fn no_value_makes_a_builder_panic() {
    let mut panics = vec![];
    for e in catalog::entries() {
        for p in e.params.iter().filter(|p| p.kind == Kind::U32) {
            for v in ["0", "1", "2", "3", "7", "13", "100", "1000"] {
                let given = shape(&[(p.name, v)]);
                if catch_unwind(AssertUnwindSafe(|| e.build(&given))).is_err() {
                    panics.push(format!("{} {}={v}", e.name, p.name));
                }
            }
        }
        for p in e.params.iter().filter(|p| p.name == "tile") {
            let tiles = [
                "0x0x0_0x0",
                "4x4x4_4x4",
                "8x8x1_4x4",
                "4x4x0_4x4",
                "64x64x16_0x8",
                "0x0x0",
                "4x0x4",
                "4x4x0",
                "5x4x4",
                "4x4x4",
                "8x1x1",
                "12x4x8",
                "64x3x32",
                "64x16x7",
                "32x8x16",
            ];
            for v in tiles {
                let given = shape(&[(p.name, v)]);
                if catch_unwind(AssertUnwindSafe(|| e.build(&given))).is_err() {
                    panics.push(format!("{} {}={v}", e.name, p.name));
                }
            }
        }
    }
    assert!(
        panics.is_empty(),
        "builders that panic:\n{}",
        panics.join("\n")
    );
}
