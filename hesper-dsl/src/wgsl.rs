//! The WGSL writer: kernel IR → text. Deterministic (the same kernel key gives byte-identical
//! text), readable (four-space indentation, parentheses only where WGSL's grammar needs them),
//! with exact literals and extensions enabled only when used.

use crate::ir::{BinaryOp, ExprKind, Func, Literal, Node, UnaryOp};
use crate::ir::{Block, Placed, Stmt, VarKind};
use crate::kernel::{Kernel, ShapeValue};
use crate::ty::Ty;

/// Where an expression sits in WGSL's grammar; decides when an operand needs parentheses.
/// (WGSL has no general precedence climbing: e.g. `a & b | c`, `a << b + c` and `a < b < c`
/// are all syntax errors, and bit operators mix with nothing without parentheses.)
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Primary,
    Unary,
    Multiplicative,
    Additive,
    Shift,
    Relational,
    Bit(BinaryOp),
    Logical(BinaryOp),
}

fn class_of(op: BinaryOp) -> Class {
    use BinaryOp::*;
    match op {
        Mul | Div | Rem => Class::Multiplicative,
        Add | Sub => Class::Additive,
        Shl | Shr => Class::Shift,
        Eq | Ne | Lt | Le | Gt | Ge => Class::Relational,
        BitAnd | BitOr | BitXor => Class::Bit(op),
        And | Or => Class::Logical(op),
    }
}

/// May an operand of class `operand` stand on the given side of an operator of class `op`?
fn fits(op: Class, operand: Class, left: bool) -> bool {
    use Class::*;
    let unary = matches!(operand, Primary | Unary);
    match op {
        Multiplicative => unary || (left && operand == Multiplicative),
        Additive => unary || operand == Multiplicative || (left && operand == Additive),
        Shift => unary,
        Relational => unary || matches!(operand, Multiplicative | Additive | Shift),
        Bit(o) => unary || (left && operand == Bit(o)),
        Logical(o) => {
            unary
                || matches!(operand, Multiplicative | Additive | Shift | Relational)
                || (left && operand == Logical(o))
        }
        Primary | Unary => unary,
    }
}

struct Writer<'a> {
    kernel: &'a Kernel,
    out: String,
    indent: usize,
}

/// Emit `kernel` (whose locals are already named in `kernel.var_names`).
pub(crate) fn emit(kernel: &Kernel) -> String {
    let mut w = Writer {
        kernel,
        out: String::new(),
        indent: 0,
    };
    w.module();
    w.out
}

fn literal(l: &Literal) -> (String, Class) {
    match *l {
        Literal::F32(v) => float(v, "f"),
        Literal::F16(v) => float(v, "h"),
        Literal::U32(v) => (format!("{v}u"), Class::Primary),
        Literal::I32(i32::MIN) => ("i32(-2147483648)".into(), Class::Primary),
        Literal::I32(v) if v < 0 => (format!("-{}i", v.unsigned_abs()), Class::Unary),
        Literal::I32(v) => (format!("{v}i"), Class::Primary),
        Literal::Bool(v) => (v.to_string(), Class::Primary),
    }
}

/// An exact float literal: Rust's `{:?}` is the shortest text that reads back to the same value
/// (Hesper once printed 1e-7 as 0), with the type suffix so it is not read as an abstract float.
/// The one exception is ±f32::MAX, whose shortest text (3.4028235e38) lies above it: Tint (the
/// browsers' compiler) rejects that as not representable, so it is written below it instead.
fn float(v: f32, suffix: &str) -> (String, Class) {
    let digits = match v.abs() == f32::MAX {
        true => "3.40282346e38".to_string(),
        false => format!("{:?}", v.abs()),
    };
    let text = format!("{digits}{suffix}");
    if v.is_sign_negative() {
        (format!("-{text}"), Class::Unary)
    } else {
        (text, Class::Primary)
    }
}

fn shape_value(v: &ShapeValue) -> String {
    match *v {
        ShapeValue::U32(x) => literal(&Literal::U32(x)).0,
        ShapeValue::I32(x) => literal(&Literal::I32(x)).0,
        ShapeValue::F32Bits(b) => literal(&Literal::F32(f32::from_bits(b))).0,
        ShapeValue::Bool(x) => x.to_string(),
    }
}

/// `array<T, 0>` in the IR is a runtime-sized storage array: `array<T>`.
fn ty(t: &Ty) -> String {
    match t {
        Ty::Array(e, 0) => format!("array<{}>", ty(e)),
        Ty::Array(e, n) => format!("array<{}, {n}>", ty(e)),
        other => other.to_string(),
    }
}

impl<'a> Writer<'a> {
    fn line(&mut self, text: &str) {
        for _ in 0..self.indent {
            self.out.push_str("    ");
        }
        self.out.push_str(text);
        self.out.push('\n');
    }

    fn module(&mut self) {
        let k = self.kernel;
        self.line(&format!("// {}", one_line(&k.key.to_string())));
        if k.uses_f16 {
            self.line("enable f16;");
        }
        if k.uses_coop {
            self.line("enable wgpu_cooperative_matrix;");
        }
        if !k.key.shape_params().is_empty() {
            self.out.push('\n');
            for (name, v) in k.key.shape_params() {
                let name = self.global(name);
                self.line(&format!("const {name}: {} = {};", v.ty(), shape_value(v)));
            }
        }
        if !k.params.is_empty() {
            self.out.push('\n');
            self.line("struct Params {");
            for p in &k.params {
                self.line(&format!("    {}: {},", p.name, p.ty.wgsl()));
            }
            self.line("}");
        }
        if !k.bindings.is_empty() || !k.params.is_empty() {
            self.out.push('\n');
        }
        for b in &k.bindings {
            self.line(&format!(
                "@group(0) @binding({}) var<storage, {}> {}: array<{}>;",
                b.binding,
                b.access.wgsl(),
                self.global(&b.name),
                ty(&b.elem)
            ));
        }
        if !k.params.is_empty() {
            if k.params_as_immediates() {
                self.line("var<immediate> params: Params;");
            } else {
                let b = k.bindings.len();
                self.line(&format!(
                    "@group(0) @binding({b}) var<uniform> params: Params;"
                ));
            }
        }
        let workgroup: Vec<_> = k
            .locals
            .iter()
            .zip(&k.var_names)
            .filter(|(l, _)| l.kind == VarKind::Workgroup)
            .collect();
        if !workgroup.is_empty() {
            self.out.push('\n');
            for (l, name) in workgroup {
                self.line(&format!("var<workgroup> {name}: {};", ty(&l.ty)));
            }
        }
        for f in &k.helpers {
            self.out.push('\n');
            self.out.push_str(helper_source(*f));
        }
        for (f, name) in k.functions.iter().zip(&k.fn_names) {
            let params: Vec<String> = f
                .params
                .iter()
                .map(|p| format!("{}: {}", self.name(*p), ty(&k.locals[p.index as usize].ty)))
                .collect();
            self.out.push('\n');
            self.line(&format!(
                "fn {name}({}) -> {} {{",
                params.join(", "),
                ty(&f.ret)
            ));
            self.block(&f.body);
            self.indent += 1;
            let value = format!("return {};", self.expr(&f.value));
            self.line(&value);
            self.indent -= 1;
            self.line("}");
        }
        self.out.push('\n');
        let [x, y, z] = k.key.wg_size();
        let size = match (y, z) {
            (1, 1) => format!("{x}"),
            (_, 1) => format!("{x}, {y}"),
            _ => format!("{x}, {y}, {z}"),
        };
        self.line(&format!("@compute @workgroup_size({size})"));
        let args: Vec<String> = k
            .builtins
            .iter()
            .map(|b| {
                let (builtin, name, t) = b.info();
                format!("@builtin({builtin}) {name}: {t}")
            })
            .collect();
        if args.len() <= 1 {
            self.line(&format!("fn main({}) {{", args.join("")));
        } else {
            self.line("fn main(");
            for a in &args {
                self.line(&format!("    {a},"));
            }
            self.line(") {");
        }
        self.block(&k.body);
        self.line("}");
    }

    fn block(&mut self, b: &Block) {
        self.indent += 1;
        for s in b {
            self.stmt(&s.stmt);
        }
        self.indent -= 1;
    }

    /// A binding's or shape constant's name in the WGSL.
    fn global<'n>(&self, name: &'n str) -> &'n str
    where
        'a: 'n,
    {
        let kernel: &'a Kernel = self.kernel;
        match kernel.global_names.iter().find(|(n, _)| n == name) {
            Some((_, emitted)) => emitted,
            None => name,
        }
    }

    fn name(&self, id: crate::ir::VarId) -> &str {
        &self.kernel.var_names[id.index as usize]
    }

    fn stmt(&mut self, s: &Stmt) {
        match s {
            Stmt::Let { id, value } => {
                let text = format!("let {} = {};", self.name(*id), self.expr(value));
                self.line(&text);
            }
            Stmt::Var { id, init } => {
                let t = ty(&self.kernel.locals[id.index as usize].ty);
                let text = match init {
                    Some(v) => format!("var {}: {t} = {};", self.name(*id), self.expr(v)),
                    None => format!("var {}: {t};", self.name(*id)),
                };
                self.line(&text);
            }
            Stmt::Assign { target, op, value } => {
                let op = op.map(|o| o.wgsl()).unwrap_or("");
                let text = format!("{} {op}= {};", self.expr(target), self.expr(value));
                self.line(&text);
            }
            Stmt::If {
                cond,
                then,
                otherwise,
            } => {
                let text = format!("if {} {{", self.expr(cond));
                self.line(&text);
                self.else_chain(then, otherwise);
            }
            Stmt::For {
                counter,
                init,
                cond,
                step_op,
                step,
                body,
            } => {
                let name = self.name(*counter).to_string();
                let t = ty(&self.kernel.locals[counter.index as usize].ty);
                let text = format!(
                    "for (var {name}: {t} = {}; {}; {name} {}= {}) {{",
                    self.expr(init),
                    self.expr(cond),
                    step_op.wgsl(),
                    self.expr(step)
                );
                self.line(&text);
                self.block(body);
                self.line("}");
            }
            Stmt::While { cond, body } => {
                let text = format!("while {} {{", self.expr(cond));
                self.line(&text);
                self.block(body);
                self.line("}");
            }
            Stmt::Loop { body } => {
                self.line("loop {");
                self.block(body);
                self.line("}");
            }
            Stmt::Break => self.line("break;"),
            Stmt::Continue => self.line("continue;"),
            Stmt::Return => self.line("return;"),
            Stmt::WorkgroupBarrier => self.line("workgroupBarrier();"),
            Stmt::UniformLoad { id, place } => {
                let text = format!(
                    "let {} = workgroupUniformLoad(&{});",
                    self.name(*id),
                    self.expr(place)
                );
                self.line(&text);
            }
            Stmt::StorageBarrier => self.line("storageBarrier();"),
            Stmt::CoopStore {
                value,
                place,
                stride,
                major,
            } => {
                let text = format!(
                    "{}({}, &{}, {});",
                    major.wgsl().1,
                    self.expr(value),
                    self.expr(place),
                    self.expr(stride)
                );
                self.line(&text);
            }
            Stmt::Comment(c) => self.line(&format!("// {c}")),
            // For the interpreter only.
            Stmt::Debug { .. } => {}
        }
    }

    /// The `then` block and an `else` / `else if` chain, closing brace included.
    fn else_chain(&mut self, then: &Block, otherwise: &Block) {
        self.block(then);
        match otherwise.as_slice() {
            [] => self.line("}"),
            [
                Placed {
                    stmt:
                        Stmt::If {
                            cond,
                            then,
                            otherwise,
                        },
                    ..
                },
            ] => {
                let text = format!("}} else if {} {{", self.expr(cond));
                self.line(&text);
                self.else_chain(then, otherwise);
            }
            _ => {
                self.line("} else {");
                self.block(otherwise);
                self.line("}");
            }
        }
    }

    fn expr(&self, n: &Node) -> String {
        self.classed(n).0
    }

    /// The operand's text, parenthesised unless it fits the operator's grammar slot.
    fn operand(&self, n: &Node, op: Class, left: bool) -> String {
        let (text, class) = self.classed(n);
        if fits(op, class, left) {
            text
        } else {
            format!("({text})")
        }
    }

    /// A call's arguments. A comparison before the last argument is parenthesised: in
    /// `f(a < b, c > d)` WGSL would read `a<b, c>` as a template list.
    fn args(&self, args: &[Node]) -> String {
        let last = args.len().saturating_sub(1);
        let texts: Vec<String> = args
            .iter()
            .enumerate()
            .map(|(i, a)| match self.classed(a) {
                (text, Class::Relational) if i < last => format!("({text})"),
                (text, _) => text,
            })
            .collect();
        texts.join(", ")
    }

    fn classed(&self, n: &Node) -> (String, Class) {
        let k = self.kernel;
        match &n.kind {
            ExprKind::Literal(l) => literal(l),
            ExprKind::Local(id) => (self.name(*id).to_string(), Class::Primary),
            ExprKind::Global(name) | ExprKind::Const(name) => {
                (self.global(name).to_string(), Class::Primary)
            }
            ExprKind::Builtin(b) => (b.info().1.to_string(), Class::Primary),
            ExprKind::Param(name) => (format!("params.{name}"), Class::Primary),
            ExprKind::ArrayLength(name) => (
                format!("arrayLength(&{})", self.global(name)),
                Class::Primary,
            ),
            ExprKind::CoopLoad {
                place,
                stride,
                major,
            } => (
                format!(
                    "{}<{}>(&{}, {})",
                    major.wgsl().0,
                    ty(&n.ty),
                    self.expr(place),
                    self.expr(stride)
                ),
                Class::Primary,
            ),
            ExprKind::Unary(op, a) => {
                let sym = match op {
                    UnaryOp::Neg => "-",
                    UnaryOp::Not => "!",
                    UnaryOp::Complement => "~",
                };
                let (text, class) = self.classed(a);
                // `- -x` would read as a decrement: parenthesise a negation of a negation.
                let needs_parens = match class {
                    Class::Primary => false,
                    Class::Unary => *op == UnaryOp::Neg && text.starts_with('-'),
                    _ => true,
                };
                let text = if needs_parens {
                    format!("({text})")
                } else {
                    text
                };
                (format!("{sym}{text}"), Class::Unary)
            }
            ExprKind::Binary(op, a, b) => {
                let class = class_of(*op);
                let mut right = self.operand(b, class, false);
                // WGSL reads `name < x >> y` as the template `name<x>`: keep `>` out of the
                // right side of `<` (see WGSL's template-list discovery).
                if matches!(op, BinaryOp::Lt | BinaryOp::Le) && has_top_level_gt(&right) {
                    right = format!("({right})");
                }
                let text = format!("{} {} {right}", self.operand(a, class, true), op.wgsl());
                (text, class)
            }
            ExprKind::Call(f, args) => {
                (format!("{}({})", f.wgsl(), self.args(args)), Class::Primary)
            }
            ExprKind::CallFunction(id, args) => (
                format!("{}({})", k.fn_names[id.index as usize], self.args(args)),
                Class::Primary,
            ),
            ExprKind::Index(base, i) => (
                format!(
                    "{}[{}]",
                    self.operand(base, Class::Primary, true),
                    self.expr(i)
                ),
                Class::Primary,
            ),
            ExprKind::Swizzle(base, pattern) => (
                format!("{}.{pattern}", self.operand(base, Class::Primary, true)),
                Class::Primary,
            ),
            ExprKind::Construct(args) => (
                format!("{}({})", ty(&n.ty), self.args(args)),
                Class::Primary,
            ),
            ExprKind::Bitcast(a) => (
                format!("bitcast<{}>({})", ty(&n.ty), self.expr(a)),
                Class::Primary,
            ),
            ExprKind::Select(f, t, c) => {
                let args = [f.clone(), t.clone(), c.clone()];
                (format!("select({})", self.args(&args)), Class::Primary)
            }
            ExprKind::Error(m) => {
                // `finish` reports error nodes before emitting; reaching here is a hesper bug.
                debug_assert!(false, "error node reached the emitter in {}: {m}", k.name());
                (format!("/* error: {m} */"), Class::Primary)
            }
        }
    }
}

/// Whether `text` has a `>` outside all parentheses and brackets (which would close a template
/// list opened by a `<` before it). A `<…>` pair inside (a type like `vec4<f32>`) does not count.
fn has_top_level_gt(text: &str) -> bool {
    let (mut depth, mut angle) = (0i32, 0i32);
    for c in text.chars() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            '<' if depth == 0 => angle += 1,
            '>' if depth == 0 => {
                if angle > 0 {
                    angle -= 1;
                } else {
                    return true;
                }
            }
            _ => {}
        }
    }
    false
}

/// The WGSL of hesper's helper functions.
fn helper_source(f: Func) -> &'static str {
    match f {
        Func::Bf16Round => {
            "// f32 -> bf16 bits (round to nearest, ties to even; NaN stays NaN), in the low 16 bits.
fn bf16_round(x: f32) -> u32 {
    let bits = bitcast<u32>(x);
    let rounded = (bits + 0x7fffu + ((bits >> 16u) & 1u)) >> 16u;
    return select(rounded, 0x7fc0u, (bits & 0x7fffffffu) > 0x7f800000u);
}
"
        }
        Func::Bf16Pack => {
            "// Two f32 -> two bf16 in one u32, `lo` in the low half.
fn bf16_pack(lo: f32, hi: f32) -> u32 {
    return bf16_round(lo) | (bf16_round(hi) << 16u);
}
"
        }
        Func::Bf16Low => {
            "fn bf16_low(packed: u32) -> f32 {
    return bitcast<f32>(packed << 16u);
}
"
        }
        Func::Bf16High => {
            "fn bf16_high(packed: u32) -> f32 {
    return bitcast<f32>(packed & 0xffff0000u);
}
"
        }
        _ => unreachable!("only helpers are collected"),
    }
}

/// Whether `c` ends a line in WGSL (its line breaks: LF, VT, FF, CR, NEL, LS, PS). Text that
/// reaches a `//` comment must hold none, or what follows one would be code.
pub(crate) fn is_line_break(c: char) -> bool {
    matches!(
        c,
        '\n' | '\u{0B}' | '\u{0C}' | '\r' | '\u{85}' | '\u{2028}' | '\u{2029}'
    )
}

/// `text` with every WGSL line break made a space: safe after `//`.
pub(crate) fn one_line(text: &str) -> String {
    text.chars()
        .map(|c| if is_line_break(c) { ' ' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_literals_are_exact() {
        assert_eq!(literal(&Literal::F32(1e-7)).0, "1e-7f");
        assert_eq!(literal(&Literal::F32(1.0)).0, "1.0f");
        assert_eq!(literal(&Literal::F32(-0.5)).0, "-0.5f");
        assert_eq!(literal(&Literal::F32(0.1)).0, "0.1f");
        assert_eq!(literal(&Literal::F32(f32::MAX)).0, "3.40282346e38f");
        assert_eq!(literal(&Literal::F32(f32::MIN)).0, "-3.40282346e38f");
        for v in [
            1e-7f32,
            0.1,
            1.0 / 3.0,
            6.022_141e23,
            1.175_494_4e-38,
            f32::MAX,
        ] {
            let text = literal(&Literal::F32(v)).0;
            let digits = text.trim_end_matches('f');
            let back: f32 = digits.parse().unwrap();
            assert_eq!(back.to_bits(), v.to_bits(), "{text}");
            // Within f32's range as written, not only once rounded (Tint checks the text).
            assert!(digits.parse::<f64>().unwrap() <= f32::MAX as f64, "{text}");
        }
        assert_eq!(literal(&Literal::I32(i32::MIN)).0, "i32(-2147483648)");
        assert_eq!(literal(&Literal::I32(-3)).0, "-3i");
    }

    #[test]
    fn grammar_slots() {
        use BinaryOp::*;
        assert!(fits(Class::Additive, Class::Multiplicative, false));
        assert!(!fits(Class::Additive, Class::Additive, false));
        assert!(fits(Class::Additive, Class::Additive, true));
        assert!(!fits(Class::Shift, Class::Additive, true));
        assert!(!fits(Class::Bit(BitAnd), Class::Bit(BitOr), true));
        assert!(fits(Class::Bit(BitAnd), Class::Bit(BitAnd), true));
        assert!(!fits(Class::Relational, Class::Relational, true));
        assert!(!fits(Class::Logical(And), Class::Logical(Or), true));
        assert!(!fits(Class::Multiplicative, Class::Multiplicative, false));
    }
}
