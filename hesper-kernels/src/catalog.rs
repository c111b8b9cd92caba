//! Every kernel of this crate by name, with its shape parameters: any of them built at any shape
//! from `name=value` text (what `hesper kernels` lists and `hesper wgsl NAME --shape k=v…`
//! prints).
//!
//! An [`Entry`] is one kernel family: the name of its [`KernelKey`](hesper_dsl::KernelKey), the
//! module that holds it, a line on what it computes, and its parameters, each with a default.
//! The defaults are the shapes of the module's `kernels()` (the WGSL snapshots): built with no
//! override, an entry's WGSL is exactly that of the first kernel of its name there.
//!
//! The parameters are what the key holds, and only that: its shape values under their own
//! names, and one parameter for each part of a key that is not a shape value — `subgroups`
//! (`true` or `false`: `Features::SUBGROUPS`, which the executor sets where the device has
//! subgroups), a workgroup size where the kernel's is not fixed (`wg`, `invocations`), and tiles:
//! the GEMM's as one `tile` value (`64x64x16_8x8` or a name, [`Tile`]), the sequence attention's
//! as one `tile` value (`64x16x32` or a name, [`SeqTile`]), the LoRA kernels' as one parameter per
//! block size (named as in the key). Whether a kernel is compiled without bounds checks
//! (`assume_in_bounds`) is fixed per kernel, never a parameter. Runtime values (token counts,
//! positions, learning rates) are not parameters either: they do not change the WGSL.
//!
//! A shape is checked as the executor checks it before it builds the kernel (a GEMM tile's
//! rules, a rank the LoRA kernels take, heads a multiple of the KV heads): what fails is a
//! [`CatalogError`] naming the kernel and the rule, as is a kernel the DSL rejects (over the
//! [`Limits`] it is built for: [`Entry::build`] takes those of the smallest device hesper
//! targets, [`Entry::build_with_limits`] others).
//!
//! ```
//! use hesper_kernels::catalog;
//!
//! let entry = catalog::find("rms_norm_forward")?;
//! let kernel = entry.build(&[("cols".into(), "576".into())])?;
//! assert!(kernel.wgsl().contains("const cols: u32 = 576u;"));
//! let err = entry.build(&[("cols".into(), "wide".into())]).unwrap_err();
//! assert_eq!(
//!     err.to_string(),
//!     "kernel `rms_norm_forward`, shape parameter `cols`: expected a u32, given `wide`"
//! );
//! # Ok::<(), catalog::CatalogError>(())
//! ```

use std::cell::Cell;
use std::fmt;

use hesper_dsl::{DslError, Features, Kernel, Limits};
use hesper_exec::ExecError;

use crate::attention::SeqTile;
use crate::attention::coop::Which as CoopWhich;
use crate::attention::sequence::build::Blocked;
use crate::linear::coop::CoopTile;
use crate::linear::{Product, Tile};
use crate::{argmax, attention, elementwise, ffn, linear, lora, loss, norm, optim, rope};

/// One kernel family, which a user can build at any shape.
pub struct Entry {
    /// The kernel's name, as in its `KernelKey` (`rms_norm_forward`).
    pub name: &'static str,
    /// The module of this crate that holds it (`norm`, `attention::decode`).
    pub module: &'static str,
    /// One line: what it computes.
    pub summary: &'static str,
    /// Its shape parameters, in order.
    pub params: &'static [Param],
    build: Build,
}

/// Builds an entry's kernel from its checked parameter values.
type Build = fn(&Shape<'_>) -> Result<Kernel, Failure>;

/// A shape parameter of an [`Entry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    /// Its name, as `--shape` gives it (`cols`).
    pub name: &'static str,
    /// What values it takes.
    pub kind: Kind,
    /// Its value when none is given (the shape of the module's `kernels()`).
    pub default: &'static str,
    /// What it is.
    pub doc: &'static str,
}

/// The values a [`Param`] takes, written as text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A `u32` in decimal.
    U32,
    /// A finite `f32` (`1e-6`, `0.125`).
    F32,
    /// `true` or `false`.
    Bool,
    /// Text of the form this says (a tile, a number or `auto`).
    Text(&'static str),
}

impl Kind {
    /// What a value must be, as errors say it ("a u32").
    pub fn expected(&self) -> &'static str {
        match self {
            Kind::U32 => "a u32",
            Kind::F32 => "a finite f32",
            Kind::Bool => "true or false",
            Kind::Text(form) => form,
        }
    }
}

/// Every kernel family of this crate, sorted by module, then name.
pub fn entries() -> &'static [Entry] {
    &ENTRIES
}

/// The entry of kernel `name`; for an unknown name, an error listing the names like it (or all).
pub fn find(name: &str) -> Result<&'static Entry, CatalogError> {
    ENTRIES
        .iter()
        .find(|e| e.name == name)
        .ok_or_else(|| CatalogError::UnknownKernel {
            name: name.into(),
            close: close_names(name),
        })
}

impl Entry {
    /// The parameter `name`, if the entry has one.
    pub fn param(&self, name: &str) -> Option<&'static Param> {
        self.params.iter().find(|p| p.name == name)
    }

    /// The kernel at the defaults overridden by `shape` (`(name, value)` pairs), checked against
    /// the [`Limits`] of the smallest device hesper targets (`Limits::default()`: 32 KiB of
    /// workgroup memory).
    pub fn build(&self, shape: &[(String, String)]) -> Result<Kernel, CatalogError> {
        self.build_with_limits(shape, &Limits::default())
    }

    /// [`Entry::build`] within a device's `limits` (`Gpu::kernel_limits` in hesper-exec).
    ///
    /// An error names the kernel, and the parameter and what it takes for a name it does not
    /// have, a name given twice or a value that does not parse; the rule for a shape the
    /// kernel does not take; the shape for a kernel the DSL rejects.
    pub fn build_with_limits(
        &self,
        shape: &[(String, String)],
        limits: &Limits,
    ) -> Result<Kernel, CatalogError> {
        let kernel = self.name.to_string();
        let mut text: Vec<&str> = self.params.iter().map(|p| p.default).collect();
        let mut given: Vec<Option<&str>> = vec![None; self.params.len()];
        for (name, value) in shape {
            let Some(i) = self.params.iter().position(|p| p.name == name) else {
                return Err(CatalogError::UnknownParam {
                    kernel,
                    param: name.clone(),
                    params: self.params.iter().map(|p| p.name.to_string()).collect(),
                });
            };
            if let Some(first) = given[i] {
                return Err(CatalogError::RepeatedParam {
                    kernel,
                    param: name.clone(),
                    first: first.into(),
                    second: value.clone(),
                });
            }
            given[i] = Some(value.as_str());
            text[i] = value.as_str();
        }
        let values = self
            .params
            .iter()
            .zip(&text)
            .map(|(p, v)| {
                Value::parse(p.kind, v).ok_or_else(|| CatalogError::Value {
                    kernel: kernel.clone(),
                    param: p.name.into(),
                    expected: p.kind.expected().into(),
                    given: v.to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let s = Shape {
            entry: self,
            values,
            limits,
            read: Cell::new(0),
        };
        let built = (self.build)(&s).map_err(|failure| match failure {
            Failure::Value(param) => CatalogError::Value {
                kernel: kernel.clone(),
                param: param.into(),
                expected: self.param(param).map_or("", |p| p.kind.expected()).into(),
                given: s.text(param).into(),
            },
            Failure::Rule { what, why } => CatalogError::Rule {
                kernel: kernel.clone(),
                what,
                why,
            },
            Failure::Dsl(error) => CatalogError::Build {
                kernel: kernel.clone(),
                shape: self
                    .params
                    .iter()
                    .zip(&text)
                    .map(|(p, v)| format!("{}={v}", p.name))
                    .collect::<Vec<_>>()
                    .join(" "),
                error: Box::new(error),
            },
        })?;
        for (i, p) in self.params.iter().enumerate() {
            debug_assert!(
                s.read.get() & (1 << i) != 0,
                "catalog entry `{}` never reads its parameter `{}`",
                self.name,
                p.name
            );
        }
        Ok(built)
    }
}

/// An entry without its builder.
impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entry")
            .field("name", &self.name)
            .field("module", &self.module)
            .field("summary", &self.summary)
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

/// A kernel the catalog could not build, and why. Every message names the kernel.
#[derive(Clone, Debug, PartialEq)]
pub enum CatalogError {
    /// No kernel of this name is in the catalog.
    UnknownKernel {
        /// The name given.
        name: String,
        /// The names like it, in catalog order (the message lists all when none is).
        close: Vec<String>,
    },
    /// The kernel has no parameter of this name.
    UnknownParam {
        /// The kernel's name.
        kernel: String,
        /// The name given.
        param: String,
        /// The parameters it has.
        params: Vec<String>,
    },
    /// A parameter given twice.
    RepeatedParam {
        /// The kernel's name.
        kernel: String,
        /// The parameter's name.
        param: String,
        /// The value given first.
        first: String,
        /// The value given second.
        second: String,
    },
    /// A value that does not parse as what the parameter takes.
    Value {
        /// The kernel's name.
        kernel: String,
        /// The parameter's name.
        param: String,
        /// What the parameter takes ([`Kind::expected`]).
        expected: String,
        /// The value given.
        given: String,
    },
    /// A shape the kernel does not take (the executor's check of it).
    Rule {
        /// The kernel's name.
        kernel: String,
        /// The value at fault (`rank = 40`, `tile Tile { … }`).
        what: String,
        /// The rule it breaks.
        why: String,
    },
    /// The DSL rejected the kernel.
    Build {
        /// The kernel's name.
        kernel: String,
        /// Every parameter's value, `name=value`, space-separated.
        shape: String,
        /// The DSL's error (naga's, or a device limit the kernel is over).
        error: Box<DslError>,
    },
}

impl fmt::Display for CatalogError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CatalogError::UnknownKernel { name, close } if close.is_empty() => {
                let all: Vec<&str> = ENTRIES.iter().map(|e| e.name).collect();
                write!(
                    f,
                    "no kernel `{name}` in the catalog; its kernels are: {}",
                    all.join(", ")
                )
            }
            CatalogError::UnknownKernel { name, close } => write!(
                f,
                "no kernel `{name}` in the catalog; close names: {}",
                close.join(", ")
            ),
            CatalogError::UnknownParam {
                kernel,
                param,
                params,
            } => {
                write!(f, "kernel `{kernel}` has no shape parameter `{param}`")?;
                match params.is_empty() {
                    true => write!(f, "; it has none"),
                    false => write!(f, "; its parameters are: {}", params.join(", ")),
                }
            }
            CatalogError::RepeatedParam {
                kernel,
                param,
                first,
                second,
            } => write!(
                f,
                "kernel `{kernel}`, shape parameter `{param}`: given twice (`{first}`, then `{second}`)"
            ),
            CatalogError::Value {
                kernel,
                param,
                expected,
                given,
            } => write!(
                f,
                "kernel `{kernel}`, shape parameter `{param}`: expected {expected}, given `{given}`"
            ),
            CatalogError::Rule { kernel, what, why } => {
                write!(f, "kernel `{kernel}`: cannot build {what}: {why}")
            }
            CatalogError::Build {
                kernel,
                shape,
                error,
            } => write!(f, "building {kernel} at {shape}: {error}"),
        }
    }
}

impl std::error::Error for CatalogError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CatalogError::Build { error, .. } => Some(error.as_ref()),
            _ => None,
        }
    }
}

/// The names like `name`: containing it or contained in it, or a few edits from it.
fn close_names(name: &str) -> Vec<String> {
    let name = name.to_lowercase();
    ENTRIES
        .iter()
        .map(|e| e.name)
        .filter(|e| {
            (!name.is_empty() && (e.contains(&name) || name.contains(e)))
                || edits(e, &name) <= 2 + name.len() / 8
        })
        .map(String::from)
        .collect()
}

/// The Levenshtein distance between `a` and `b`.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// Why a module's catalog constructor built no kernel; [`Entry::build_with_limits`] names the
/// kernel and the shape.
#[derive(Debug)]
pub(crate) enum Failure {
    Dsl(DslError),
    /// A shape the kernel does not take: the value at fault and the rule.
    Rule {
        what: String,
        why: String,
    },
    /// A [`Kind::Text`] parameter whose value does not have its form.
    Value(&'static str),
}

impl Failure {
    /// A shape the kernel does not take: the value at fault and the rule (the catalog names
    /// the kernel).
    pub(crate) fn rule(what: String, why: String) -> Failure {
        Failure::Rule { what, why }
    }
}

impl From<DslError> for Failure {
    fn from(error: DslError) -> Failure {
        Failure::Dsl(error)
    }
}

/// The executor's shape checks (tiles, ranks, heads) fail with `ExecError::Dispatch`.
impl From<ExecError> for Failure {
    fn from(error: ExecError) -> Failure {
        match error {
            ExecError::Dispatch { what, why, .. } => Failure::Rule { what, why },
            other => Failure::Rule {
                what: "this shape".into(),
                why: other.to_string(),
            },
        }
    }
}

/// A parameter's value, parsed as its [`Kind`] says.
#[derive(Clone, Debug)]
enum Value {
    U32(u32),
    F32(f32),
    Bool(bool),
    Text(String),
}

impl Value {
    fn parse(kind: Kind, text: &str) -> Option<Value> {
        match kind {
            Kind::U32 => text.parse().ok().map(Value::U32),
            Kind::F32 => text
                .parse::<f32>()
                .ok()
                .filter(|v| v.is_finite())
                .map(Value::F32),
            Kind::Bool => text.parse().ok().map(Value::Bool),
            Kind::Text(_) => Some(Value::Text(text.into())),
        }
    }
}

/// An entry's parameter values for one build, read by name by its builder.
pub(crate) struct Shape<'a> {
    entry: &'a Entry,
    values: Vec<Value>,
    limits: &'a Limits,
    /// Bit `i`: parameter `i` was read (every builder reads all of its parameters).
    read: Cell<u64>,
}

impl Shape<'_> {
    fn value(&self, name: &str) -> &Value {
        let Some(i) = self.entry.params.iter().position(|p| p.name == name) else {
            panic!(
                "catalog entry `{}` reads `{name}`, which it does not list",
                self.entry.name
            )
        };
        self.read.set(self.read.get() | 1 << i);
        &self.values[i]
    }

    fn mismatch(&self, name: &str, kind: &str) -> ! {
        panic!(
            "catalog entry `{}` reads `{name}` as {kind}, which it does not list it as",
            self.entry.name
        )
    }

    fn u32(&self, name: &str) -> u32 {
        match self.value(name) {
            Value::U32(v) => *v,
            _ => self.mismatch(name, "a u32"),
        }
    }

    fn f32(&self, name: &str) -> f32 {
        match self.value(name) {
            Value::F32(v) => *v,
            _ => self.mismatch(name, "an f32"),
        }
    }

    fn bool(&self, name: &str) -> bool {
        match self.value(name) {
            Value::Bool(v) => *v,
            _ => self.mismatch(name, "a bool"),
        }
    }

    fn text(&self, name: &str) -> &str {
        match self.value(name) {
            Value::Text(v) => v,
            _ => self.mismatch(name, "text"),
        }
    }

    /// A [`Kind::Text`] parameter through `parse` (`None`: not of its form).
    fn parse<T>(&self, name: &'static str, parse: fn(&str) -> Option<T>) -> Result<T, Failure> {
        parse(self.text(name)).ok_or(Failure::Value(name))
    }

    /// `Features::SUBGROUPS` when the parameter `subgroups` is true.
    fn features(&self) -> Features {
        match self.bool("subgroups") {
            true => Features::SUBGROUPS,
            false => Features::NONE,
        }
    }

    /// `τ`: the parameter `tau`, `auto` being `1/√head_dim` as the executor forms it.
    fn tau(&self, head_dim: u32) -> Result<f32, Failure> {
        match self.text("tau") {
            "auto" => Ok(attention::decode::build::tau(head_dim)),
            v => v
                .parse::<f32>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or(Failure::Value("tau")),
        }
    }

    fn limits(&self) -> &Limits {
        self.limits
    }
}

/// `BMxBNxBK_TMxTN` or a standard tile's name.
fn gemm_tile(text: &str) -> Option<Tile> {
    let named = match text {
        "large" => Some(Tile::LARGE),
        "medium" => Some(Tile::MEDIUM),
        "small" => Some(Tile::SMALL),
        "portable" => Some(Tile::PORTABLE),
        _ => None,
    };
    if named.is_some() {
        return named;
    }
    let (block, thread) = text.split_once('_')?;
    match (&numbers(block)?[..], &numbers(thread)?[..]) {
        (&[bm, bn, bk], &[tm, tn]) => Some(Tile { bm, bn, bk, tm, tn }),
        _ => None,
    }
}

/// `BLOCKxBKxVK` or a standard tile's name.
fn seq_tile(text: &str) -> Option<SeqTile> {
    match text {
        "large" => Some(SeqTile::LARGE),
        "medium" => Some(SeqTile::MEDIUM),
        "portable" => Some(SeqTile::PORTABLE),
        _ => match numbers(text)?[..] {
            [block, bk, vk] => Some(SeqTile { block, bk, vk }),
            _ => None,
        },
    }
}

/// `AxBx…` as numbers.
fn numbers(text: &str) -> Option<Vec<u32>> {
    text.split('x').map(|n| n.parse().ok()).collect()
}

/// The sequence attention's blocked kernels, whose parameters are alike.
/// The tensor-core sequence attention kernels.
fn coop_attention(s: &Shape<'_>, which: CoopWhich) -> Result<Kernel, Failure> {
    let dims = (s.u32("head_dim"), s.u32("heads"), s.u32("kv_heads"));
    let split = match which {
        CoopWhich::QueryGrads => 1,
        _ => s.u32("split"),
    };
    let tile = attention::coop::CoopSeqTile {
        subgroups: s.u32("row_tiles"),
        step: s.u32("step"),
        split,
    };
    let subgroup = s.u32("subgroup");
    attention::coop::build::kernel(which, dims, (tile, subgroup), s.bool("padded"), s.limits())
}

fn blocked(s: &Shape<'_>, which: Blocked) -> Result<Kernel, Failure> {
    let dims = (s.u32("head_dim"), s.u32("heads"), s.u32("kv_heads"));
    let tile = s.parse("tile", seq_tile)?;
    let padded = s.bool("padded");
    attention::sequence::build::blocked(which, dims, tile, padded, s.limits())
}

/// The GEMMs, whose parameters are alike.
fn gemm(s: &Shape<'_>, kernel: (Product, bool)) -> Result<Kernel, Failure> {
    let dims = (s.u32("cols"), s.u32("depth"));
    let tile = s.parse("tile", gemm_tile)?;
    // The ternary GEMMs take no f16 buffers.
    let flag = |name| !kernel.1 && s.bool(name);
    let half = linear::HalfBuffers {
        input: flag("input_f16"),
        weight: flag("weight_f16"),
        output: flag("output_f16"),
    };
    linear::build::gemm(kernel, dims, tile, (s.bool("accumulate"), half), s.limits())
}

/// `BMxBNxBK_WMxWN` or a standard tensor-core tile's name.
fn coop_tile(text: &str) -> Option<CoopTile> {
    let named = match text {
        "large" => Some(CoopTile::LARGE),
        "wide" => Some(CoopTile::WIDE),
        "wide12" => Some(CoopTile::WIDE_12),
        "medium" => Some(CoopTile::MEDIUM),
        "small" => Some(CoopTile::SMALL),
        "tall" => Some(CoopTile::TALL),
        "narrow" => Some(CoopTile::NARROW),
        _ => None,
    };
    if named.is_some() {
        return named;
    }
    let (block, subgroup) = text.split_once('_')?;
    match (&numbers(block)?[..], &numbers(subgroup)?[..]) {
        (&[bm, bn, bk], &[wm, wn]) => Some(CoopTile { bm, bn, bk, wm, wn }),
        _ => None,
    }
}

/// The tensor-core GEMMs, whose parameters are alike.
fn coop_gemm(s: &Shape<'_>, product: Product) -> Result<Kernel, Failure> {
    let dims = (s.u32("cols"), s.u32("depth"));
    let tile = s.parse("tile", coop_tile)?;
    let types = linear::HalfBuffers {
        input: s.bool("input_f16"),
        weight: s.bool("weight_f16"),
        output: s.bool("output_f16"),
    };
    let subgroup = s.u32("subgroup");
    let accumulate = s.bool("accumulate");
    linear::coop::build::gemm(
        product,
        dims,
        (tile, subgroup),
        types,
        (accumulate, s.u32("splits")),
        s.limits(),
    )
}

/// The row width, rank and layout of the LoRA kernels.
fn adapter(s: &Shape<'_>) -> (u32, u32, bool) {
    (s.u32("n"), s.u32("rank"), s.bool("rank_minor"))
}

const fn u32_param(name: &'static str, default: &'static str, doc: &'static str) -> Param {
    Param {
        name,
        kind: Kind::U32,
        default,
        doc,
    }
}

const fn bool_param(name: &'static str, default: &'static str, doc: &'static str) -> Param {
    Param {
        name,
        kind: Kind::Bool,
        default,
        doc,
    }
}

const SUBGROUPS: Param = bool_param(
    "subgroups",
    "true",
    "subgroup operations (Features::SUBGROUPS; the executor sets it where the device has \
     subgroups)",
);
/// The cross-entropy row kernels' parameters.
const CROSS_ENTROPY_ROW_PARAMS: &[Param] = &[
    u32_param(
        "vocab",
        "2000",
        "the vocabulary V (a multiple of 4 goes as vec4s)",
    ),
    u32_param(
        "wg",
        "256",
        "invocations per workgroup (the executor's: 1024, or the device's most)",
    ),
    SUBGROUPS,
];
const TAU: Param = Param {
    name: "tau",
    kind: Kind::Text("an f32, or `auto` for 1/√head_dim"),
    default: "auto",
    doc: "the score scale τ (the executor's is 1/√head_dim)",
};
const DECODE_HEAD_DIM: Param = u32_param("head_dim", "128", "the head dimension hd");
const GROUP: Param = u32_param("group", "4", "query heads per KV head, G = H / KV");

const SEQ_HEAD_DIM: Param = u32_param(
    "head_dim",
    "64",
    "the head dimension hd (a multiple of 4, at most 128)",
);
const SEQ_HEADS: Param = u32_param("heads", "9", "query heads H");
const SEQ_KV_HEADS: Param = u32_param(
    "kv_heads",
    "3",
    "key/value heads KV (H a multiple of KV: GQA)",
);
const PADDED: Param = bool_param(
    "padded",
    "true",
    "the batch has valid lengths (right padding): keys past a sequence's length are excluded, \
     rows past it are zeros",
);
const SEQ_TILE: Param = Param {
    name: "tile",
    kind: Kind::Text("a tile BLOCKxBKxVK (e.g. 64x16x32), or large, medium or portable"),
    default: "large",
    doc: "block: rows and keys per workgroup ((block/4)² invocations); bk: depth of a score \
          step (the key holds the first of bk, 16, 8, 4 at most bk that divides hd); vk: rows \
          per accumulator step. The executor picks large 64x16x32, medium 64x16x16 or \
          portable 32x16x8 by the device's workgroup memory; another tile is built as given \
          (block a multiple of 4, vk dividing it), untested on a GPU",
};
const SEQ_PARAMS: &[Param] = &[SEQ_HEAD_DIM, SEQ_HEADS, SEQ_KV_HEADS, PADDED, SEQ_TILE];
const COOP_ROW_TILES: Param = u32_param(
    "row_tiles",
    "2",
    "tiles of 16 rows a workgroup owns, one a subgroup (the executor: 4 for the forward and dQ, \
     2 for dK/dV; fewer where memory is short)",
);
const COOP_STEP: Param = u32_param(
    "step",
    "32",
    "rows of the other side a step (a multiple of 16; the executor: 16 for the forward, 32 for \
     the gradients, 16 where memory is short)",
);
const COOP_SEQ_PARAMS: &[Param] = &[
    SEQ_HEAD_DIM,
    SEQ_HEADS,
    SEQ_KV_HEADS,
    PADDED,
    COOP_ROW_TILES,
    COOP_STEP,
    COOP_SUBGROUP,
];
const COOP_SPLIT: Param = u32_param(
    "split",
    "1",
    "subgroups a row tile, each taking step/split of a step's rows (their sums added when \
     stored)",
);
const COOP_SEQ_SPLIT_PARAMS: &[Param] = &[
    SEQ_HEAD_DIM,
    SEQ_HEADS,
    SEQ_KV_HEADS,
    PADDED,
    COOP_ROW_TILES,
    COOP_STEP,
    COOP_SUBGROUP,
    COOP_SPLIT,
];
const COOP_SEQ_KV_PARAMS: &[Param] = &[
    SEQ_HEAD_DIM,
    SEQ_HEADS,
    SEQ_KV_HEADS,
    PADDED,
    COOP_ROW_TILES,
    COOP_STEP,
    COOP_SUBGROUP,
    COOP_SPLIT,
    bool_param(
        "write_scores",
        "false",
        "also write the scores' gradients dSᵀ (f16, [B, H, S', S'], S' the sequence rounded up \
         to 64) for coop_attention_backward_q_from_scores",
    ),
];

const GEMM_TILE: Param = Param {
    name: "tile",
    kind: Kind::Text(
        "a tile BMxBNxBK_TMxTN (e.g. 64x64x16_8x8), or large, medium, small or portable",
    ),
    default: "16x16x4_4x4",
    doc: "bm×bn outputs per workgroup, bk of the depth a step, tm×tn outputs per invocation \
          (the executor's: medium 64x64x16_8x8; large 128x128x8_8x8, small 64x64x16_4x4, \
          portable 64x64x8_4x8)",
};
const COOP_TILE: Param = Param {
    name: "tile",
    kind: Kind::Text(
        "a tile BMxBNxBK_WMxWN (e.g. 128x256x32_64x64), or large, wide12, wide, medium, tall, small or narrow",
    ),
    default: "32x32x16_16x16",
    doc: "bm×bn outputs per workgroup, bk of the depth a step, wm×wn per subgroup (the \
          standard tiles: large 128x256x32_64x64, wide12 128x192x48_32x64, wide 128x192x48_64x64, medium 128x128x32_64x32, tall \
          128x64x32_64x32, small 64x64x32_32x32, narrow 64x32x32_32x16; the executor tunes \
          among them)",
};
const COOP_SUBGROUP: Param = u32_param(
    "subgroup",
    "32",
    "invocations a subgroup (the device's fixed size: NVIDIA 32)",
);
const GEMM_ACCUMULATE: Param = bool_param(
    "accumulate",
    "false",
    "add into the output rather than overwrite it",
);
const HALF_INPUT: Param = bool_param(
    "input_f16",
    "false",
    "the input is f16, read as f32 (a key holds it only when true)",
);
const HALF_WEIGHT: Param = bool_param(
    "weight_f16",
    "false",
    "the weight is f16, read as f32 (a key holds it only when true)",
);
const HALF_OUTPUT: Param = bool_param(
    "output_f16",
    "false",
    "the output is f16, rounded when stored (a key holds it only when true)",
);
const GEMM_ACCUMULATE_ON: Param = Param {
    default: "true",
    ..GEMM_ACCUMULATE
};

const COOP_SPLITS: Param = u32_param(
    "splits",
    "1",
    "parts of the depth, each summed into its own slice of the output (split-K; 1: none)",
);

const LORA_N: Param = u32_param("n", "64", "the row width (the layer's in or out)");
const RANK_MINOR: Param = bool_param(
    "rank_minor",
    "true",
    "the weight is rank-minor, [n, r] (B); false: rank-major, [r, n] (A)",
);

static ENTRIES: [Entry; 56] = [
    // argmax
    Entry {
        name: "argmax",
        module: "argmax",
        summary: "greedy decoding's choice: out[offset + r] = the first maximum's index of row r",
        params: &[SUBGROUPS],
        build: |s| Ok(argmax::build(s.features(), s.limits())?),
    },
    // attention::coop
    Entry {
        name: "coop_attention_backward_kv",
        module: "attention::coop",
        summary: "causal attention backward on tensor cores, one workgroup per KV block: dK and \
                  dV (f16 products, f32 sums), recomputing P = exp(τ·S − lse); with \
                  write_scores, dS too",
        params: COOP_SEQ_KV_PARAMS,
        build: |s| {
            let write_scores = s.bool("write_scores");
            coop_attention(s, CoopWhich::KeyGrads { write_scores })
        },
    },
    Entry {
        name: "coop_attention_backward_q",
        module: "attention::coop",
        summary: "causal attention backward on tensor cores, one workgroup per query block: dQ \
                  (f16 products, f32 sums)",
        params: COOP_SEQ_PARAMS,
        build: |s| coop_attention(s, CoopWhich::QueryGrads),
    },
    Entry {
        name: "coop_attention_backward_q_from_scores",
        module: "attention::coop",
        summary: "causal attention backward on tensor cores, one workgroup per query block: dQ = \
                  dS·K over the scores' gradients coop_attention_backward_kv wrote (masked as \
                  staged)",
        params: COOP_SEQ_SPLIT_PARAMS,
        build: |s| coop_attention(s, CoopWhich::QueryGradsFromScores),
    },
    Entry {
        name: "coop_attention_forward",
        module: "attention::coop",
        summary: "causal attention over whole sequences on tensor cores (GQA): O and lse, two \
                  passes over the keys (statistics, then P·V), f16 products, f32 softmax",
        params: COOP_SEQ_SPLIT_PARAMS,
        build: |s| coop_attention(s, CoopWhich::Forward),
    },
    // attention::decode
    Entry {
        name: "apply_backward",
        module: "attention::decode",
        summary: "decode backward through A·V: dA[h, s] = Σ_d dO[h, d]·V[h/G, s, d]",
        params: &[DECODE_HEAD_DIM, GROUP],
        build: |s| {
            attention::decode::build::apply_backward(s.u32("head_dim"), s.u32("group"), s.limits())
        },
    },
    Entry {
        name: "cache_backward",
        module: "attention::decode",
        summary: "decode backward into the KV cache: dK += τ·Σ_g dS·q, dV += Σ_g A·dO over each \
                  KV head's query heads",
        params: &[DECODE_HEAD_DIM, GROUP, TAU],
        build: |s| {
            let hd = s.u32("head_dim");
            let dims = (hd, s.u32("group"), s.tau(hd)?);
            attention::decode::build::cache_backward(dims, s.limits())
        },
    },
    Entry {
        name: "decode_attention",
        module: "attention::decode",
        summary: "one token's attention over the KV cache: A = softmax(τ·q·Kᵀ), O = A·V",
        params: &[
            u32_param("head_dim", "128", "the head dimension hd (at most 128)"),
            GROUP,
            TAU,
            SUBGROUPS,
        ],
        build: |s| {
            let hd = s.u32("head_dim");
            let dims = (hd, s.u32("group"), s.tau(hd)?);
            attention::decode::build::decode_attention(dims, s.features(), s.limits())
        },
    },
    Entry {
        name: "kv_cache_append",
        module: "attention::decode",
        summary: "writes one token's keys and values into row pos of each KV head's cache",
        params: &[DECODE_HEAD_DIM],
        build: |s| attention::decode::build::kv_cache_append(s.u32("head_dim"), s.limits()),
    },
    Entry {
        name: "score_backward_q",
        module: "attention::decode",
        summary: "decode backward to the query: dQ[h, d] = τ·Σ_s dS[h, s]·K[h/G, s, d]",
        params: &[DECODE_HEAD_DIM, GROUP, TAU],
        build: |s| {
            let hd = s.u32("head_dim");
            let dims = (hd, s.u32("group"), s.tau(hd)?);
            attention::decode::build::score_backward_q(dims, s.limits())
        },
    },
    Entry {
        name: "softmax_backward",
        module: "attention::decode",
        summary: "row softmax backward: dS = P ⊙ (dP − Σ_j P·dP), one workgroup per row",
        params: &[
            bool_param(
                "lanes4",
                "true",
                "rows read as vec4s (the row length a multiple of 4)",
            ),
            SUBGROUPS,
        ],
        build: |s| {
            attention::decode::build::softmax_backward(s.bool("lanes4"), s.features(), s.limits())
        },
    },
    // attention::sequence
    Entry {
        name: "attention_backward_kv",
        module: "attention::sequence",
        summary: "causal attention backward, one workgroup per KV block: dK and dV, recomputing \
                  P = exp(τ·S − lse)",
        params: SEQ_PARAMS,
        build: |s| blocked(s, Blocked::KeyGrads),
    },
    Entry {
        name: "attention_backward_q",
        module: "attention::sequence",
        summary: "causal attention backward, one workgroup per query block: dQ, recomputing \
                  P = exp(τ·S − lse)",
        params: SEQ_PARAMS,
        build: |s| blocked(s, Blocked::QueryGrads),
    },
    Entry {
        name: "attention_backward_stats",
        module: "attention::sequence",
        summary: "the attention backward's pre-pass: (lse, D = rowsum(dO ⊙ O)) per row, packed",
        params: &[
            SEQ_HEAD_DIM,
            SEQ_HEADS,
            PADDED,
            u32_param(
                "lanes",
                "1",
                "invocations a row, a power of two dividing head_dim / 4 (more than 1: their \
                 sums added by subgroup shuffles; the executor takes up to 16 where the device \
                 has subgroups)",
            ),
        ],
        build: |s| {
            let dims = (s.u32("head_dim"), s.u32("heads"));
            attention::sequence::build::stats(dims, s.bool("padded"), s.u32("lanes"), s.limits())
        },
    },
    Entry {
        name: "attention_forward",
        module: "attention::sequence",
        summary: "causal flash attention over whole sequences (GQA): O = softmax(τ·Q·Kᵀ + \
                  causal)·V and each row's log-sum-exp",
        params: SEQ_PARAMS,
        build: |s| blocked(s, Blocked::Forward),
    },
    // elementwise
    Entry {
        name: "add",
        module: "elementwise",
        summary: "the residual add y += x, over vec4s",
        params: &[],
        build: |s| elementwise::build::add(s.limits()),
    },
    Entry {
        name: "add_bias",
        module: "elementwise",
        summary: "a bias broadcast over rows: y[r, :] += bias",
        params: &[u32_param(
            "cols",
            "64",
            "the row width (a multiple of 4 goes as vec4s)",
        )],
        build: |s| elementwise::build::add_bias(s.u32("cols"), s.limits()),
    },
    Entry {
        name: "embedding",
        module: "elementwise",
        summary: "the token embedding lookup: out[t, :] = table[tokens[t], :], zeros past the \
                  vocabulary",
        params: &[u32_param(
            "dim",
            "64",
            "the row width (a multiple of 4 goes as vec4s)",
        )],
        build: |s| elementwise::build::embedding(s.u32("dim"), s.limits()),
    },
    // ffn
    Entry {
        name: "relu_sqr_mul_backward",
        module: "ffn",
        summary: "ReLU²×Mul backward: du = dh·relu(g)², dg = dh·u·2·relu(g)",
        params: &[],
        build: |s| ffn::build::relu_sqr_mul_backward(s.limits()),
    },
    Entry {
        name: "relu_sqr_mul_forward",
        module: "ffn",
        summary: "ReLU²×Mul (BitNet): h = relu(g)²·u",
        params: &[],
        build: |s| ffn::build::relu_sqr_mul_forward(s.limits()),
    },
    Entry {
        name: "swiglu_backward",
        module: "ffn",
        summary: "SwiGLU backward: du = dh·g·σ, dg = dh·u·σ·(1 + g·(1 − σ))",
        params: &[],
        build: |s| ffn::build::swiglu_backward(s.limits()),
    },
    Entry {
        name: "swiglu_forward",
        module: "ffn",
        summary: "SwiGLU (Llama): h = silu(g)·u",
        params: &[],
        build: |s| ffn::build::swiglu_forward(s.limits()),
    },
    Entry {
        name: "swiglu_packed_backward",
        module: "ffn",
        summary: "SwiGLU backward over rows of gate then up (one GEMM's [T, 2I] output): \
                  d_gate_up packed the same way",
        params: &[],
        build: |s| ffn::build::swiglu_packed_backward(s.limits()),
    },
    Entry {
        name: "swiglu_packed_backward_f16",
        module: "ffn",
        summary: "the packed SwiGLU backward from f16 gate_up: d_gate_up in f16, scaled by \
                  2^e before rounding as the tensor-core GEMM that reads it would scale it",
        params: &[],
        build: |s| ffn::build::swiglu_packed_backward_f16(s.limits()),
    },
    Entry {
        name: "swiglu_packed_forward",
        module: "ffn",
        summary: "SwiGLU over rows of gate then up (one GEMM's [T, 2I] output): h = silu(g)·u",
        params: &[],
        build: |s| ffn::build::swiglu_packed_forward(s.limits()),
    },
    Entry {
        name: "swiglu_packed_forward_f16",
        module: "ffn",
        summary: "the packed SwiGLU from f16 gate_up (a mixed-precision step's GEMM output): \
                  h = silu(g)·u in f32",
        params: &[],
        build: |s| ffn::build::swiglu_packed_forward_f16(s.limits()),
    },
    Entry {
        name: "swiglu_packed_forward_half",
        module: "ffn",
        summary: "the packed SwiGLU in f16 both ways: h = silu(g)·u rounded to f16 as it is \
                  stored, for the tensor-core GEMM that reads it (the down projection)",
        params: &[],
        build: |s| ffn::build::swiglu_packed_forward_half(s.limits()),
    },
    // linear
    Entry {
        name: "bitlinear_forward",
        module: "linear",
        summary: "the tiled GEMM through BitNet's ternary weight: y (+)= s·x·Tᵀ",
        params: &[
            u32_param("cols", "64", "output columns: the weight's rows n"),
            u32_param("depth", "32", "the contraction: the weight's columns k"),
            GEMM_TILE,
            GEMM_ACCUMULATE,
        ],
        build: |s| gemm(s, (Product::Nt, true)),
    },
    Entry {
        name: "bitlinear_transpose",
        module: "linear",
        summary: "the tiled GEMM through the transposed ternary weight: dx (+)= s·dy·T",
        params: &[
            u32_param("cols", "32", "output columns: the weight's columns k"),
            u32_param("depth", "64", "the contraction: the weight's rows n"),
            GEMM_TILE,
            GEMM_ACCUMULATE_ON,
        ],
        build: |s| gemm(s, (Product::Nn, true)),
    },
    Entry {
        name: "gemv",
        module: "linear",
        summary: "y (+)= x·Wᵀ over a few rows (decoding's one token): a workgroup per output",
        params: &[
            u32_param(
                "depth",
                "36",
                "the contraction: the weight's columns k (a multiple of 4 goes as vec4s)",
            ),
            GEMM_ACCUMULATE,
            SUBGROUPS,
        ],
        build: |s| {
            let (depth, accumulate) = (s.u32("depth"), s.bool("accumulate"));
            Ok(linear::gemv::build(
                (depth, 0),
                accumulate,
                s.features(),
                s.limits(),
            )?)
        },
    },
    Entry {
        name: "gemv_lora",
        module: "linear",
        summary: "y (+)= x·Wᵀ + s·(x·Aᵀ)·Bᵀ over a few rows in one launch (decoding's LoRA \
                  projection): a workgroup per output",
        params: &[
            u32_param(
                "depth",
                "36",
                "the contraction: the weight's columns k (a multiple of 4 goes as vec4s)",
            ),
            u32_param("rank", "2", "the adapter's rank r, 1 to 32"),
            GEMM_ACCUMULATE,
            SUBGROUPS,
        ],
        build: |s| {
            let (depth, rank) = (s.u32("depth"), s.u32("rank"));
            if !(1..=linear::gemv::MAX_RANK as u32).contains(&rank) {
                return Err(Failure::rule(
                    format!("rank = {rank}"),
                    "the rank must be 1 to 32".into(),
                ));
            }
            let accumulate = s.bool("accumulate");
            Ok(linear::gemv::build(
                (depth, rank),
                accumulate,
                s.features(),
                s.limits(),
            )?)
        },
    },
    Entry {
        name: "matmul_nn",
        module: "linear",
        summary: "the tiled GEMM back through a dense weight: dx (+)= dy·W",
        params: &[
            u32_param("cols", "32", "output columns: the weight's columns k"),
            u32_param("depth", "64", "the contraction: the weight's rows n"),
            GEMM_TILE,
            GEMM_ACCUMULATE_ON,
            HALF_INPUT,
            HALF_WEIGHT,
            HALF_OUTPUT,
        ],
        build: |s| gemm(s, (Product::Nn, false)),
    },
    Entry {
        name: "matmul_nt",
        module: "linear",
        summary: "the tiled GEMM through a dense weight: y (+)= x·Wᵀ",
        params: &[
            u32_param("cols", "60", "output columns: the weight's rows n"),
            u32_param("depth", "36", "the contraction: the weight's columns k"),
            GEMM_TILE,
            GEMM_ACCUMULATE,
            HALF_INPUT,
            HALF_WEIGHT,
            HALF_OUTPUT,
        ],
        build: |s| gemm(s, (Product::Nt, false)),
    },
    Entry {
        name: "coop_matmul_nn",
        module: "linear::coop",
        summary: "the GEMM back through a dense weight on tensor cores (cooperative matrices): \
                  dx (+)= s·dy·W, f16 products summed in f32",
        params: &[
            u32_param("cols", "64", "output columns: the weight's columns k"),
            u32_param("depth", "32", "the contraction: the weight's rows n"),
            COOP_TILE,
            COOP_SUBGROUP,
            bool_param(
                "input_f16",
                "true",
                "dy is f16 (else f32, rounded as it is read)",
            ),
            bool_param(
                "weight_f16",
                "true",
                "the weight is f16 (else f32, rounded)",
            ),
            bool_param("output_f16", "false", "dx is f16 (else f32)"),
            GEMM_ACCUMULATE_ON,
            COOP_SPLITS,
        ],
        build: |s| coop_gemm(s, Product::Nn),
    },
    Entry {
        name: "coop_matmul_nt",
        module: "linear::coop",
        summary: "the GEMM through a dense weight on tensor cores (cooperative matrices): \
                  y (+)= s·x·Wᵀ, f16 products summed in f32",
        params: &[
            u32_param("cols", "60", "output columns: the weight's rows n"),
            u32_param("depth", "36", "the contraction: the weight's columns k"),
            COOP_TILE,
            COOP_SUBGROUP,
            bool_param(
                "input_f16",
                "false",
                "x is f16 (else f32, rounded as it is read)",
            ),
            bool_param(
                "weight_f16",
                "false",
                "the weight is f16 (else f32, rounded)",
            ),
            bool_param("output_f16", "true", "y is f16 (else f32)"),
            GEMM_ACCUMULATE,
            COOP_SPLITS,
        ],
        build: |s| coop_gemm(s, Product::Nt),
    },
    Entry {
        name: "gemm_split_sum",
        module: "linear::split",
        summary: "a split GEMM's parts added: out (+)= the sum of its f32 slices, over vec4s",
        params: &[
            u32_param(
                "parts",
                "4",
                "the slices (the split's parts of the depth), 1 to 16",
            ),
            bool_param(
                "accumulate",
                "true",
                "add the sum to out (else overwrite it)",
            ),
        ],
        build: |s| linear::split::build::sum(s.u32("parts"), s.bool("accumulate"), s.limits()),
    },
    // lora
    Entry {
        name: "lora_down",
        module: "lora",
        summary: "the products into r (h = x·Aᵀ, dh = dy·B) without subgroups: a slice of rows \
                  staged in workgroup memory",
        params: &[
            LORA_N,
            u32_param("rank", "1", "the rank r (1 to 32)"),
            RANK_MINOR,
            u32_param(
                "token_lanes",
                "4",
                "invocations along the tokens, 4 tokens each",
            ),
            u32_param(
                "column_lanes",
                "64",
                "invocations along the columns, 4 columns each a step (the executor's: 64, or \
                 32 where the device has less than 27 KiB of workgroup memory)",
            ),
            u32_param("pitch", "18", "floats per column of the staged slice"),
            u32_param(
                "round_sums",
                "8",
                "partial sums per invocation a round of the reduction",
            ),
            u32_param(
                "span",
                "8",
                "column slices one invocation adds in the first level",
            ),
        ],
        build: |s| {
            let tile = ["token_lanes", "column_lanes", "pitch", "round_sums", "span"];
            lora::build::lora_down(adapter(s), tile.map(|p| s.u32(p)), s.limits())
        },
    },
    Entry {
        name: "lora_down_subgroups",
        module: "lora",
        summary: "the products into r (h = x·Aᵀ, dh = dy·B) on subgroups of one known size: a \
                  butterfly of shuffles",
        params: &[
            LORA_N,
            u32_param("rank", "2", "the rank r (1 to 32)"),
            RANK_MINOR,
            bool_param(
                "pair",
                "false",
                "two weights (w, w2) of one layout into two outputs (out, out2) over the same \
                 rows: 2·rank at most 32",
            ),
            u32_param(
                "second_n",
                "0",
                "with pair, the width of the second weight's own input (a2); 0: both read a",
            ),
            u32_param(
                "lanes",
                "32",
                "the device's subgroup size (8 to invocations, dividing it)",
            ),
            u32_param("invocations", "256", "invocations per workgroup"),
            u32_param("group_tokens", "16", "tokens per workgroup"),
            u32_param("unroll", "4", "token rows read before computing"),
        ],
        build: |s| {
            let tile = ["invocations", "group_tokens", "unroll"].map(|p| s.u32(p));
            let lanes = (s.bool("pair"), s.u32("second_n"), s.u32("lanes"));
            lora::build::lora_down_subgroups(adapter(s), lanes, tile, s.limits())
        },
    },
    Entry {
        name: "lora_up",
        module: "lora",
        summary: "the products out of r: y += s·h·Bᵀ, dx += s·dh·A",
        params: &[
            LORA_N,
            u32_param("rank", "4", "the rank r (1 to 32)"),
            Param {
                default: "false",
                ..RANK_MINOR
            },
            u32_param("invocations", "256", "invocations per workgroup"),
            u32_param("block_tokens", "16", "tokens each invocation walks"),
            u32_param("unroll", "4", "output reads in flight"),
        ],
        build: |s| {
            let tile = ["invocations", "block_tokens", "unroll"].map(|p| s.u32(p));
            lora::build::lora_up(adapter(s), tile, s.limits())
        },
    },
    Entry {
        name: "lora_weight_grad_partials",
        module: "lora",
        summary: "the weight gradients' first pass: Σ over each block of tokens of u[t, j]·v[t, k]",
        params: &[
            LORA_N,
            u32_param(
                "second",
                "48",
                "the width of a second gradient's u (u2, v2) whose workgroups follow the \
                 first's in the same launch (dA after dB); 0 for none",
            ),
            u32_param("rank", "2", "the rank r"),
            u32_param("cols", "32", "invocations along the columns"),
            u32_param("lanes", "4", "invocations along the tokens"),
            u32_param("lane_tokens", "64", "tokens of the block each lane sums"),
            u32_param("unroll", "8", "rows in flight"),
            u32_param(
                "round_sums",
                "16",
                "the lanes' sums added per invocation a round",
            ),
        ],
        build: |s| {
            let dims = (["n", "second"].map(|p| s.u32(p)), s.u32("rank"));
            let tile = ["cols", "lanes", "lane_tokens", "unroll", "round_sums"].map(|p| s.u32(p));
            lora::build::lora_weight_grad_partials(dims, tile, s.limits())
        },
    },
    Entry {
        name: "lora_weight_grad_sum",
        module: "lora",
        summary: "the weight gradients' second pass: G = s·Σ_blocks partials, in G's layout",
        params: &[
            LORA_N,
            u32_param("rank", "2", "the rank r"),
            RANK_MINOR,
            u32_param(
                "second",
                "48",
                "the width of a second gradient summed in the same launch (dA after dB); 0 for \
                 none",
            ),
            bool_param("second_rank_minor", "false", "the second gradient's layout"),
            u32_param(
                "third",
                "20",
                "the width of a third gradient (a second adapter's dB); 0 for none",
            ),
            bool_param("third_rank_minor", "true", "the third gradient's layout"),
            u32_param(
                "fourth",
                "64",
                "the width of a fourth gradient (a second adapter's dA); 0 for none",
            ),
            bool_param("fourth_rank_minor", "false", "the fourth gradient's layout"),
            u32_param(
                "invocations",
                "256",
                "invocations per workgroup, one output each",
            ),
            u32_param("loads", "16", "blocks read a step"),
        ],
        build: |s| {
            let (n, r, rank_minor) = adapter(s);
            let tile = ["invocations", "loads"].map(|p| s.u32(p));
            let part = |name: &str| (s.u32(name), s.bool(&format!("{name}_rank_minor")));
            let parts = [
                (n, rank_minor),
                part("second"),
                part("third"),
                part("fourth"),
            ];
            lora::build::lora_weight_grad_sum((parts, r), tile, s.limits())
        },
    },
    // loss
    Entry {
        name: "cross_entropy",
        module: "loss",
        summary: "cross-entropy rows, one workgroup per token: its loss and its row of dz = \
                  (softmax(z) − onehot(y)) / N",
        params: CROSS_ENTROPY_ROW_PARAMS,
        build: |s| {
            let (vocab, wg) = (s.u32("vocab"), s.u32("wg"));
            loss::build::cross_entropy_rows(
                loss::RowOutput::Grad,
                vocab,
                wg,
                s.features(),
                s.limits(),
            )
        },
    },
    Entry {
        name: "cross_entropy_count",
        module: "loss",
        summary: "N, the tokens whose label is a class (one workgroup)",
        params: &[
            u32_param("vocab", "2000", "the vocabulary V"),
            u32_param(
                "wg",
                "256",
                "invocations per workgroup (the executor's: 1024, or the device's most)",
            ),
        ],
        build: |s| loss::build::cross_entropy_count(s.u32("vocab"), s.u32("wg"), s.limits()),
    },
    Entry {
        name: "cross_entropy_forward",
        module: "loss",
        summary: "cross-entropy rows without the gradient: each token's loss",
        params: CROSS_ENTROPY_ROW_PARAMS,
        build: |s| {
            let (vocab, wg) = (s.u32("vocab"), s.u32("wg"));
            loss::build::cross_entropy_rows(
                loss::RowOutput::Loss,
                vocab,
                wg,
                s.features(),
                s.limits(),
            )
        },
    },
    Entry {
        name: "cross_entropy_mean",
        module: "loss",
        summary: "the loss: Σ_t token_loss[t] / max(N, 1) (one workgroup)",
        params: &[u32_param(
            "wg",
            "256",
            "invocations per workgroup (the executor's: 1024, or the device's most)",
        )],
        build: |s| loss::build::cross_entropy_mean(s.u32("wg"), s.limits()),
    },
    Entry {
        name: "cross_entropy_stats",
        module: "loss",
        summary: "cross-entropy rows, one workgroup per token: its loss and its row's (log-sum-exp, \
                  1/N), from which the lm-head's backward GEMM computes dz as it reads the \
                  logits (loss::CrossEntropyGrad)",
        params: CROSS_ENTROPY_ROW_PARAMS,
        build: |s| {
            let (vocab, wg) = (s.u32("vocab"), s.u32("wg"));
            loss::build::cross_entropy_rows(
                loss::RowOutput::Stats,
                vocab,
                wg,
                s.features(),
                s.limits(),
            )
        },
    },
    // norm
    Entry {
        name: "rms_norm_backward",
        module: "norm",
        summary: "RMSNorm backward: dx (+)= r·m − (r³/n)·(Σ m·x)·x, m = dy·γ, one workgroup per \
                  row",
        params: &[
            u32_param(
                "cols",
                "2560",
                "the row width n (a multiple of 4 goes as vec4s)",
            ),
            bool_param(
                "accumulate",
                "true",
                "add dx into the buffer rather than overwrite it",
            ),
            SUBGROUPS,
        ],
        build: |s| {
            let (cols, accumulate) = (s.u32("cols"), s.bool("accumulate"));
            norm::build::rms_norm_backward(cols, accumulate, s.features(), s.limits())
        },
    },
    Entry {
        name: "rms_norm_dgamma_partials",
        module: "norm",
        summary: "dγ's first pass: Σ over each block of rows of dy·x·rstd, per column",
        params: &[
            u32_param("cols", "2560", "the row width n"),
            u32_param(
                "rows_per_block",
                "32",
                "rows per partial sum (the executor's: 32)",
            ),
        ],
        build: |s| {
            let (cols, rows) = (s.u32("cols"), s.u32("rows_per_block"));
            norm::build::rms_norm_dgamma_partials(cols, rows, s.limits())
        },
    },
    Entry {
        name: "rms_norm_dgamma_sum",
        module: "norm",
        summary: "dγ's second pass: the sum of the partials over blocks, per column",
        params: &[u32_param("cols", "2560", "the row width n")],
        build: |s| norm::build::rms_norm_dgamma_sum(s.u32("cols"), s.limits()),
    },
    Entry {
        name: "rms_norm_forward",
        module: "norm",
        summary: "RMSNorm: y = x·r·γ, r = (mean x² + ε)^-½ saved per row, one workgroup per row",
        params: &[
            u32_param(
                "cols",
                "2560",
                "the row width n (a multiple of 4 goes as vec4s)",
            ),
            Param {
                name: "eps",
                kind: Kind::F32,
                default: "1e-6",
                doc: "ε",
            },
            SUBGROUPS,
        ],
        build: |s| {
            let (cols, eps) = (s.u32("cols"), s.f32("eps"));
            norm::build::rms_norm_forward(cols, eps, s.features(), s.limits())
        },
    },
    // optim
    Entry {
        name: "adamw",
        module: "optim",
        summary: "AdamW over one tensor (bias-corrected, decoupled weight decay), one vec4 per \
                  invocation",
        params: &[bool_param(
            "clip",
            "false",
            "scale the gradient by min(1, max_norm / (‖g‖ + 1e-6)), ‖g‖ read from a buffer",
        )],
        build: |s| optim::build::adamw(s.bool("clip"), s.limits()),
    },
    Entry {
        name: "grad_norm_finish",
        module: "optim",
        summary: "the global gradient norm's second pass: norm = √(Σ partials) (one workgroup)",
        params: &[],
        build: |s| optim::build::grad_norm_finish(s.limits()),
    },
    Entry {
        name: "grad_norm_partials",
        module: "optim",
        summary: "the global gradient norm's first pass: a sum of squares per workgroup",
        params: &[],
        build: |s| optim::build::grad_norm_partials(s.limits()),
    },
    // rope
    Entry {
        name: "rope",
        module: "rope",
        summary: "RoPE, split-half layout, in place: pairs (x_i, x_{i+hd/2}) rotated by \
                  pos·base^(−2i/hd)",
        params: &[
            u32_param("half", "64", "half the head dimension, hd / 2"),
            bool_param(
                "backward",
                "false",
                "the backward: the rotation with sin → −sin",
            ),
        ],
        build: |s| rope::build::rope(s.u32("half"), s.bool("backward"), s.limits()),
    },
    Entry {
        name: "rope_qk_vec4",
        module: "rope",
        summary: "RoPE of a layer's queries and keys in one launch, each as `rope_vec4`; what \
                  execute_rope_qk runs when hd / 2 is a multiple of 4",
        params: &[
            u32_param(
                "half",
                "32",
                "half the head dimension, hd / 2: a multiple of 4",
            ),
            bool_param(
                "backward",
                "false",
                "the backward: the rotation with sin → −sin",
            ),
        ],
        build: |s| rope::build::rope_qk_vec4(s.u32("half"), s.bool("backward"), s.limits()),
    },
    Entry {
        name: "rope_vec4",
        module: "rope",
        summary: "RoPE as `rope`, four pairs an invocation (vec4s of each half of a head); \
                  what execute_rope runs when hd / 2 is a multiple of 4",
        params: &[
            u32_param(
                "half",
                "32",
                "half the head dimension, hd / 2: a multiple of 4",
            ),
            bool_param(
                "backward",
                "false",
                "the backward: the rotation with sin → −sin",
            ),
        ],
        build: |s| rope::build::rope_vec4(s.u32("half"), s.bool("backward"), s.limits()),
    },
];
