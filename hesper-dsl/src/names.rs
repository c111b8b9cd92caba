//! Names: which ones a user may give (bindings, runtime scalars, shape parameters), and fresh,
//! readable, never-colliding names for locals and workgroup arrays.

use std::collections::HashSet;

use crate::ir::{Builtin, Func};
use crate::kernel::Kernel;

/// WGSL keywords and reserved words (WGSL spec §15.1–15.2).
const RESERVED: &[&str] = &[
    "alias",
    "break",
    "case",
    "const",
    "const_assert",
    "continue",
    "continuing",
    "default",
    "diagnostic",
    "discard",
    "else",
    "enable",
    "false",
    "fn",
    "for",
    "if",
    "let",
    "loop",
    "override",
    "requires",
    "return",
    "struct",
    "switch",
    "true",
    "var",
    "while",
    "NULL",
    "Self",
    "abstract",
    "active",
    "alignas",
    "alignof",
    "as",
    "asm",
    "asm_fragment",
    "async",
    "attribute",
    "auto",
    "await",
    "become",
    "cast",
    "catch",
    "class",
    "co_await",
    "co_return",
    "co_yield",
    "coherent",
    "column_major",
    "common",
    "compile",
    "compile_fragment",
    "concept",
    "const_cast",
    "consteval",
    "constexpr",
    "constinit",
    "crate",
    "debugger",
    "decltype",
    "delete",
    "demote",
    "demote_to_helper",
    "do",
    "dynamic_cast",
    "enum",
    "explicit",
    "export",
    "extends",
    "extern",
    "external",
    "fallthrough",
    "filter",
    "final",
    "finally",
    "friend",
    "from",
    "fxgroup",
    "get",
    "goto",
    "groupshared",
    "highp",
    "impl",
    "implements",
    "import",
    "inline",
    "instanceof",
    "interface",
    "layout",
    "lowp",
    "macro",
    "macro_rules",
    "match",
    "mediump",
    "meta",
    "mod",
    "module",
    "move",
    "mut",
    "mutable",
    "namespace",
    "new",
    "nil",
    "noexcept",
    "noinline",
    "nointerpolation",
    "non_coherent",
    "noncoherent",
    "noperspective",
    "null",
    "nullptr",
    "of",
    "operator",
    "package",
    "packoffset",
    "partition",
    "pass",
    "patch",
    "pixelfragment",
    "precise",
    "precision",
    "premerge",
    "priv",
    "protected",
    "pub",
    "public",
    "readonly",
    "ref",
    "regardless",
    "register",
    "reinterpret_cast",
    "require",
    "resource",
    "restrict",
    "self",
    "set",
    "shared",
    "sizeof",
    "smooth",
    "snorm",
    "static",
    "static_assert",
    "static_cast",
    "std",
    "subroutine",
    "super",
    "target",
    "template",
    "this",
    "thread_local",
    "throw",
    "trait",
    "try",
    "type",
    "typedef",
    "typeid",
    "typename",
    "typeof",
    "union",
    "unless",
    "unorm",
    "unsafe",
    "unsized",
    "use",
    "using",
    "varying",
    "virtual",
    "volatile",
    "wgsl",
    "where",
    "with",
    "writeonly",
    "yield",
];

/// Predeclared names a local must not shadow (types and the functions the emitter calls), and
/// the names the emitter itself uses.
const PREDECLARED: &[&str] = &[
    "f32",
    "f16",
    "i32",
    "u32",
    "bool",
    "vec2",
    "vec3",
    "vec4",
    "array",
    "atomic",
    "ptr",
    "mat2x2",
    "mat3x3",
    "mat4x4",
    "arrayLength",
    "bitcast",
    "select",
    "workgroupBarrier",
    "storageBarrier",
    "coop_mat8x8",
    "coop_mat16x16",
    "coopLoad",
    "coopLoadT",
    "coopStore",
    "coopStoreT",
    "main",
    "params",
    "Params",
];

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name != "_"
        && !name.starts_with("__")
}

fn is_taken_by_language(name: &str) -> bool {
    RESERVED.contains(&name)
        || PREDECLARED.contains(&name)
        || Builtin::ALL.iter().any(|b| b.info().1 == name)
        || ALL_FUNCS.iter().any(|f| f.wgsl() == name)
}

const ALL_FUNCS: [Func; 32] = [
    Func::Abs,
    Func::Min,
    Func::Max,
    Func::Clamp,
    Func::Exp,
    Func::Exp2,
    Func::Log,
    Func::Log2,
    Func::Sqrt,
    Func::InverseSqrt,
    Func::Tanh,
    Func::Sin,
    Func::Cos,
    Func::Pow,
    Func::Fma,
    Func::Floor,
    Func::Ceil,
    Func::Round,
    Func::Fract,
    Func::Sign,
    Func::Mix,
    Func::Dot,
    Func::SubgroupAdd,
    Func::SubgroupMax,
    Func::SubgroupMin,
    Func::SubgroupShuffleXor,
    Func::SubgroupBroadcast,
    Func::Bf16Round,
    Func::Bf16Pack,
    Func::Bf16Low,
    Func::Bf16High,
    Func::CoopMultiplyAdd,
];

/// Whether `name` may name a binding, runtime scalar or shape parameter (kept as given, since
/// the executor binds by it).
pub(crate) fn check_user_name(name: &str) -> Result<(), String> {
    if !is_identifier(name) {
        return Err(
            "not a WGSL identifier ([A-Za-z_][A-Za-z0-9_]*, not `_`, not starting with `__`)"
                .into(),
        );
    }
    if is_taken_by_language(name) {
        return Err("reserved by WGSL or by the emitter".into());
    }
    Ok(())
}

/// WGSL's cooperative-matrix roles: predeclared enumerants that a module-scope name of the
/// same spelling hides, which breaks every `coop_mat16x16<f16, A>` after it.
const COOP_ROLES: [&str; 3] = ["A", "B", "C"];

/// The emitted names of a kernel's items.
pub(crate) struct Names {
    /// Each local and workgroup array, by index.
    pub vars: Vec<String>,
    /// Each function, by index.
    pub fns: Vec<String>,
    /// Bindings and shape constants emitted under another name than their own (one that would
    /// hide a cooperative-matrix role): the executor binds by the binding's own name, so only
    /// the WGSL text changes.
    pub globals: Vec<(String, String)>,
}

/// Names for every local and workgroup array, and every function, of `kernel`, by index: the
/// hint when it is free, else `hint_1`, `hint_2`, … Deterministic: depends only on declaration
/// order. Functions are named first (they are module-scope).
pub(crate) fn assign(kernel: &Kernel) -> Names {
    let mut taken: HashSet<String> = HashSet::new();
    taken.extend(kernel.bindings.iter().map(|b| b.name.clone()));
    taken.extend(kernel.params.iter().map(|p| p.name.clone()));
    taken.extend(kernel.key.shape_params().iter().map(|(n, _)| n.clone()));
    let coop = kernel.uses_coop;
    if coop {
        taken.extend(COOP_ROLES.map(String::from));
    }
    let mut fresh = |hint: &str| {
        let base = sanitize(hint);
        let mut name = base.clone();
        let mut n = 0;
        while taken.contains(&name) || is_taken_by_language(&name) {
            n += 1;
            name = format!("{base}_{n}");
        }
        taken.insert(name.clone());
        name
    };
    let globals = kernel
        .bindings
        .iter()
        .map(|b| b.name.as_str())
        .chain(kernel.key.shape_params().iter().map(|(n, _)| n.as_str()))
        .filter(|name| coop && COOP_ROLES.contains(name))
        .map(|name| (name.to_string(), fresh(name)))
        .collect();
    let fns = kernel.functions.iter().map(|f| fresh(&f.hint)).collect();
    let vars = kernel.locals.iter().map(|l| fresh(&l.hint)).collect();
    Names { vars, fns, globals }
}

fn sanitize(hint: &str) -> String {
    let mut s: String = hint
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    while s.starts_with("__") {
        s.remove(0);
    }
    if s.is_empty() || s == "_" || s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, 'v');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_names() {
        assert!(check_user_name("d_gate").is_ok());
        assert!(check_user_name("loop").is_err());
        assert!(check_user_name("max").is_err());
        assert!(check_user_name("global_id").is_err());
        assert!(check_user_name("params").is_err());
        assert!(check_user_name("9x").is_err());
        assert!(check_user_name("__x").is_err());
        assert!(check_user_name("a-b").is_err());
    }

    #[test]
    fn sanitized_hints() {
        assert_eq!(sanitize("row sum"), "row_sum");
        assert_eq!(sanitize("2x"), "v2x");
        assert_eq!(sanitize(""), "v");
        assert_eq!(sanitize("__t"), "_t");
    }
}
