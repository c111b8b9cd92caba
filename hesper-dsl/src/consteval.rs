//! WGSL evaluates every constant subexpression (literals, shape `const`s and builtins over them)
//! when the shader is created, and rejects the whole shader when one overflows or leaves a
//! function's domain (`1.0f / 0.0f`, `pow(-2.5f, 2.0f)`, `0u - 1u`). This module evaluates
//! those subexpressions on the host first, so the builder reports them as the user's error
//! instead of handing naga text it will reject. Where WGSL's rule is subtle, it errs on the side
//! of reporting.

use std::cell::RefCell;
use std::collections::HashMap;

use crate::ir::{BinaryOp, ExprKind, Func, Literal, Node, UnaryOp, VarId};
use crate::kernel::{KernelKey, ShapeValue};
use crate::ty::{Scalar, Ty};

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Value {
    /// f32 or f16 (the scalar says which), held as f32.
    Float(f32, Scalar),
    I32(i32),
    U32(u32),
    Bool(bool),
    Vector(Vec<Value>),
}

pub(crate) type Eval = Result<Value, String>;

/// What a constant may refer to: shape parameters, and `let`s bound to constants (naga folds
/// those too, so `let u = 0u; x % u` is rejected like `x % 0u`).
pub(crate) struct Scope<'a> {
    pub key: &'a KernelKey,
    pub lets: &'a HashMap<VarId, Node>,
    /// Each `let`'s value once evaluated: chains of lets stay linear.
    pub memo: &'a RefCell<HashMap<VarId, Option<Eval>>>,
}

/// `None` when `n` is not a constant expression; else its value, or why WGSL would reject it.
pub(crate) fn check(n: &Node, key: &Scope) -> Option<Result<(), String>> {
    eval(n, key).map(|r| r.map(|_| ()))
}

/// Checks WGSL makes on runtime expressions whose *operand* is constant: an integer divisor of
/// zero, a shift by the bit width or more, a constant index past a fixed-size array or vector.
pub(crate) fn check_operands(n: &Node, key: &Scope) -> Result<(), String> {
    let constant = |m: &Node| eval(m, key).and_then(Result::ok);
    let components = |v: Value| match v {
        Value::Vector(c) => c,
        s => vec![s],
    };
    match &n.kind {
        ExprKind::Binary(BinaryOp::Div | BinaryOp::Rem, _, b) if b.ty.scalar().is_integer() => {
            if let Some(v) = constant(b)
                && components(v)
                    .iter()
                    .any(|c| matches!(c, Value::I32(0) | Value::U32(0)))
            {
                return Err("integer division or remainder by a constant zero".into());
            }
        }
        ExprKind::Binary(BinaryOp::Shl | BinaryOp::Shr, _, b) => {
            if let Some(v) = constant(b)
                && components(v)
                    .iter()
                    .any(|c| matches!(c, Value::U32(x) if *x >= 32))
            {
                return Err("shift by a constant of 32 or more".into());
            }
        }
        ExprKind::Index(base, i) => {
            // naga also refuses a constant index of u32::MAX into a runtime-sized array.
            let len = match &base.ty {
                Ty::Array(_, 0) => Some(u32::MAX as i64),
                Ty::Array(_, n) => Some(*n as i64),
                Ty::Vector(n, _) => Some(*n as i64),
                _ => None,
            };
            let index = match constant(i) {
                Some(Value::U32(x)) => Some(x as i64),
                Some(Value::I32(x)) => Some(x as i64),
                _ => None,
            };
            if let (Some(len), Some(index)) = (len, index)
                && !(0..len).contains(&index)
            {
                return Err(format!(
                    "constant index {index} is out of bounds for {}",
                    base.ty
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

fn float(v: f64, s: Scalar) -> Eval {
    let max = if s == Scalar::F16 {
        65504.0
    } else {
        f32::MAX as f64
    };
    if !v.is_finite() || v.abs() > max {
        return Err(format!("evaluates to {v}, which {} cannot hold", s.wgsl()));
    }
    let f = v as f32;
    Ok(Value::Float(
        if s == Scalar::F16 { f16_round(f) } else { f },
        s,
    ))
}

/// Round an f32 to the nearest f16 value (ties to even), kept as f32.
fn f16_round(v: f32) -> f32 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let e = v.abs().log2().floor().max(-14.0);
    let ulp = 2f32.powf(e - 10.0);
    let q = v / ulp;
    let r = q.round();
    let r = if (q - q.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - q.signum()
    } else {
        r
    };
    r * ulp
}

fn eval(n: &Node, key: &Scope) -> Option<Eval> {
    let args = |nodes: &[&Node]| -> Option<Result<Vec<Value>, String>> {
        let mut out = vec![];
        for a in nodes {
            match eval(a, key)? {
                Ok(v) => out.push(v),
                Err(e) => return Some(Err(e)),
            }
        }
        Some(Ok(out))
    };
    let r = match &n.kind {
        ExprKind::Literal(l) => Ok(match *l {
            Literal::F32(v) => Value::Float(v, Scalar::F32),
            Literal::F16(v) => Value::Float(v, Scalar::F16),
            Literal::I32(v) => Value::I32(v),
            Literal::U32(v) => Value::U32(v),
            Literal::Bool(v) => Value::Bool(v),
        }),
        ExprKind::Local(id) => {
            if let Some(known) = key.memo.borrow().get(id) {
                return known.clone();
            }
            let value = eval(key.lets.get(id)?, key);
            key.memo.borrow_mut().insert(*id, value.clone());
            return value;
        }
        ExprKind::Const(name) => match key.key.get(name)? {
            ShapeValue::U32(v) => Ok(Value::U32(v)),
            ShapeValue::I32(v) => Ok(Value::I32(v)),
            ShapeValue::F32Bits(b) => Ok(Value::Float(f32::from_bits(b), Scalar::F32)),
            ShapeValue::Bool(v) => Ok(Value::Bool(v)),
        },
        ExprKind::Unary(op, a) => match args(&[a])? {
            Ok(v) => unary(*op, &v[0]),
            Err(e) => Err(e),
        },
        ExprKind::Binary(op, a, b) => match args(&[a, b])? {
            Ok(v) => binary(*op, &v[0], &v[1]),
            Err(e) => Err(e),
        },
        ExprKind::Call(f, call_args) if !f.is_subgroup() && !f.is_helper() => {
            let refs: Vec<&Node> = call_args.iter().collect();
            match args(&refs)? {
                Ok(v) => call(*f, &v),
                Err(e) => Err(e),
            }
        }
        // A cooperative matrix is never a constant (naga refuses to evaluate one).
        ExprKind::Construct(_) if matches!(n.ty, Ty::CoopMatrix { .. }) => return None,
        ExprKind::Construct(parts) => {
            let refs: Vec<&Node> = parts.iter().collect();
            match args(&refs)? {
                Ok(v) => construct(&n.ty, v),
                Err(e) => Err(e),
            }
        }
        ExprKind::Bitcast(a) => match args(&[a])? {
            Ok(v) => map1(&v[0], &|x| bitcast(x, n.ty.scalar())),
            Err(e) => Err(e),
        },
        ExprKind::Select(f, t, c) => match args(&[f, t, c])? {
            Ok(v) => Ok(match &v[2] {
                Value::Bool(true) => v[1].clone(),
                _ => v[0].clone(),
            }),
            Err(e) => Err(e),
        },
        ExprKind::Swizzle(a, pattern) => match args(&[a])? {
            Ok(v) => match &v[0] {
                Value::Vector(c) => {
                    let pick = |ch: char| {
                        c["xyzw".find(ch).or_else(|| "rgba".find(ch)).unwrap_or(0)].clone()
                    };
                    let picked: Vec<Value> = pattern.chars().map(pick).collect();
                    Ok(if picked.len() == 1 {
                        picked[0].clone()
                    } else {
                        Value::Vector(picked)
                    })
                }
                other => Ok(other.clone()),
            },
            Err(e) => Err(e),
        },
        ExprKind::Index(a, i) => match args(&[a, i])? {
            Ok(v) => match (&v[0], &v[1]) {
                (Value::Vector(c), Value::U32(i)) if (*i as usize) < c.len() => {
                    Ok(c[*i as usize].clone())
                }
                (Value::Vector(c), Value::I32(i)) if *i >= 0 && (*i as usize) < c.len() => {
                    Ok(c[*i as usize].clone())
                }
                _ => Err("a constant index is out of bounds".into()),
            },
            Err(e) => Err(e),
        },
        _ => return None,
    };
    Some(r)
}

fn map1(a: &Value, f: &dyn Fn(&Value) -> Eval) -> Eval {
    match a {
        Value::Vector(c) => Ok(Value::Vector(c.iter().map(f).collect::<Result<_, _>>()?)),
        s => f(s),
    }
}

/// Apply `f` component-wise, splatting a scalar against a vector.
fn map2(a: &Value, b: &Value, f: &dyn Fn(&Value, &Value) -> Eval) -> Eval {
    match (a, b) {
        (Value::Vector(x), Value::Vector(y)) => Ok(Value::Vector(
            x.iter()
                .zip(y)
                .map(|(p, q)| f(p, q))
                .collect::<Result<_, _>>()?,
        )),
        (Value::Vector(x), s) => Ok(Value::Vector(
            x.iter().map(|p| f(p, s)).collect::<Result<_, _>>()?,
        )),
        (s, Value::Vector(y)) => Ok(Value::Vector(
            y.iter().map(|q| f(s, q)).collect::<Result<_, _>>()?,
        )),
        (p, q) => f(p, q),
    }
}

fn unary(op: UnaryOp, a: &Value) -> Eval {
    map1(a, &|v| match (op, v) {
        (UnaryOp::Neg, Value::Float(x, s)) => Ok(Value::Float(-x, *s)),
        (UnaryOp::Neg, Value::I32(x)) => x
            .checked_neg()
            .map(Value::I32)
            .ok_or_else(|| "-i32::MIN overflows".into()),
        (UnaryOp::Not, Value::Bool(x)) => Ok(Value::Bool(!x)),
        (UnaryOp::Complement, Value::I32(x)) => Ok(Value::I32(!x)),
        (UnaryOp::Complement, Value::U32(x)) => Ok(Value::U32(!x)),
        _ => Err("unsupported constant operation".into()),
    })
}

fn binary(op: BinaryOp, a: &Value, b: &Value) -> Eval {
    use BinaryOp::*;
    if let (And | Or, Value::Bool(x), Value::Bool(y)) = (op, a, b) {
        return Ok(Value::Bool(if op == And { *x && *y } else { *x || *y }));
    }
    map2(a, b, &|x, y| {
        let overflow = || format!("`{}` overflows", op.wgsl());
        match (x, y) {
            (Value::Float(p, s), Value::Float(q, _)) => {
                // f32 arithmetic, as the GPU and naga do it; f16 is checked for range after.
                let (p, q) = (*p, *q);
                match op {
                    Add => float((p + q) as f64, *s),
                    Sub => float((p - q) as f64, *s),
                    Mul => float((p * q) as f64, *s),
                    Div => float((p / q) as f64, *s),
                    Rem => float((p % q) as f64, *s),
                    _ => Ok(Value::Bool(compare(op, p.partial_cmp(&q)))),
                }
            }
            (Value::I32(p), Value::I32(q)) => match op {
                Add => p.checked_add(*q).map(Value::I32).ok_or_else(overflow),
                Sub => p.checked_sub(*q).map(Value::I32).ok_or_else(overflow),
                Mul => p.checked_mul(*q).map(Value::I32).ok_or_else(overflow),
                Div => p
                    .checked_div(*q)
                    .map(Value::I32)
                    .ok_or_else(|| "division by zero or overflow".into()),
                Rem => p
                    .checked_rem(*q)
                    .map(Value::I32)
                    .ok_or_else(|| "remainder by zero or overflow".into()),
                BitAnd => Ok(Value::I32(p & q)),
                BitOr => Ok(Value::I32(p | q)),
                BitXor => Ok(Value::I32(p ^ q)),
                _ => Ok(Value::Bool(compare(op, p.partial_cmp(q)))),
            },
            (Value::U32(p), Value::U32(q)) => match op {
                Add => p.checked_add(*q).map(Value::U32).ok_or_else(overflow),
                Sub => p.checked_sub(*q).map(Value::U32).ok_or_else(overflow),
                Mul => p.checked_mul(*q).map(Value::U32).ok_or_else(overflow),
                Div => p
                    .checked_div(*q)
                    .map(Value::U32)
                    .ok_or_else(|| "division by zero".into()),
                Rem => p
                    .checked_rem(*q)
                    .map(Value::U32)
                    .ok_or_else(|| "remainder by zero".into()),
                BitAnd => Ok(Value::U32(p & q)),
                BitOr => Ok(Value::U32(p | q)),
                BitXor => Ok(Value::U32(p ^ q)),
                Shl => shift_left(*p as u64, *q, 32, false).map(|v| Value::U32(v as u32)),
                Shr => (*q < 32)
                    .then(|| Value::U32(p >> q))
                    .ok_or_else(|| "shift by 32 or more".into()),
                _ => Ok(Value::Bool(compare(op, p.partial_cmp(q)))),
            },
            (Value::I32(p), Value::U32(q)) => match op {
                Shl => shift_left(*p as i64 as u64, *q, 32, true).map(|v| Value::I32(v as i32)),
                Shr => (*q < 32)
                    .then(|| Value::I32(p >> q))
                    .ok_or_else(|| "shift by 32 or more".into()),
                _ => Err("unsupported constant operation".into()),
            },
            (Value::Bool(p), Value::Bool(q)) => match op {
                BitAnd => Ok(Value::Bool(p & q)),
                BitOr => Ok(Value::Bool(p | q)),
                _ => Ok(Value::Bool(compare(op, p.partial_cmp(q)))),
            },
            _ => Err("unsupported constant operation".into()),
        }
    })
}

fn x_f32(v: &Value) -> f32 {
    match v {
        Value::Float(x, _) => *x,
        _ => 0.0,
    }
}

/// A constant `<<` must not shift out any set bit (nor, for i32, change the sign).
fn shift_left(v: u64, by: u32, bits: u32, signed: bool) -> Result<u64, String> {
    if by >= bits {
        return Err("shift by 32 or more".into());
    }
    let mask = (1u64 << bits) - 1;
    let shifted = (v << by) & mask;
    let keep = if signed { by + 1 } else { by };
    let lost = (v & mask) >> (bits - keep);
    let all_ones = (1u64 << keep) - 1;
    if lost != 0 && !(signed && lost == all_ones) {
        return Err("`<<` shifts out set bits".into());
    }
    Ok(shifted)
}

fn compare(op: BinaryOp, ord: Option<std::cmp::Ordering>) -> bool {
    use std::cmp::Ordering::*;
    match (op, ord) {
        (BinaryOp::Eq, o) => o == Some(Equal),
        (BinaryOp::Ne, o) => o != Some(Equal),
        (BinaryOp::Lt, o) => o == Some(Less),
        (BinaryOp::Le, o) => matches!(o, Some(Less | Equal)),
        (BinaryOp::Gt, o) => o == Some(Greater),
        (BinaryOp::Ge, o) => matches!(o, Some(Greater | Equal)),
        _ => false,
    }
}

fn call(f: Func, args: &[Value]) -> Eval {
    use Func::*;
    let scalars = |v: &Value| -> Vec<Value> {
        match v {
            Value::Vector(c) => c.clone(),
            s => vec![s.clone()],
        }
    };
    if f == Dot {
        let (a, b) = (scalars(&args[0]), scalars(&args[1]));
        let mut acc = match a.first() {
            Some(Value::Float(_, s)) => Value::Float(0.0, *s),
            Some(Value::I32(_)) => Value::I32(0),
            _ => Value::U32(0),
        };
        for (x, y) in a.iter().zip(&b) {
            acc = binary(BinaryOp::Add, &acc, &binary(BinaryOp::Mul, x, y)?)?;
        }
        return Ok(acc);
    }
    // Every other builtin here is component-wise.
    let width = args.iter().map(|a| scalars(a).len()).max().unwrap_or(1);
    let mut out = vec![];
    for i in 0..width {
        let comp: Vec<Value> = args
            .iter()
            .map(|a| {
                let s = scalars(a);
                s[i.min(s.len() - 1)].clone()
            })
            .collect();
        out.push(call_scalar(f, &comp)?);
    }
    Ok(if args.iter().any(|a| matches!(a, Value::Vector(_))) {
        Value::Vector(out)
    } else {
        out.remove(0)
    })
}

fn call_scalar(f: Func, a: &[Value]) -> Eval {
    use Func::*;
    match a[0] {
        Value::Float(_, s) => {
            let x: Vec<f64> = a.iter().map(|v| x_f32(v) as f64).collect();
            let domain = |ok: bool| {
                if ok {
                    Ok(())
                } else {
                    Err(format!("`{}` argument is out of its domain", f.wgsl()))
                }
            };
            let v = match f {
                Abs => x[0].abs(),
                Min => x[0].min(x[1]),
                Max => x[0].max(x[1]),
                Clamp => {
                    domain(x[1] <= x[2])?;
                    x[0].clamp(x[1], x[2])
                }
                Exp => x[0].exp(),
                Exp2 => x[0].exp2(),
                Log | Log2 => {
                    domain(x[0] > 0.0)?;
                    if f == Log { x[0].ln() } else { x[0].log2() }
                }
                Sqrt => {
                    domain(x[0] >= 0.0)?;
                    x[0].sqrt()
                }
                InverseSqrt => {
                    domain(x[0] > 0.0)?;
                    1.0 / x[0].sqrt()
                }
                Tanh => x[0].tanh(),
                Sin => x[0].sin(),
                Cos => x[0].cos(),
                Pow => {
                    domain(x[0] > 0.0 || (x[0] == 0.0 && x[1] > 0.0))?;
                    x[0].powf(x[1])
                }
                Fma => x[0] * x[1] + x[2],
                Floor => x[0].floor(),
                Ceil => x[0].ceil(),
                Round => x[0].round_ties_even(),
                Fract => x[0] - x[0].floor(),
                Sign => x[0].signum() * (x[0] != 0.0) as i32 as f64,
                Mix => x[0] * (1.0 - x[2]) + x[1] * x[2],
                _ => {
                    return Err(format!(
                        "`{}` is not evaluated as a constant here",
                        f.wgsl()
                    ));
                }
            };
            float(v, s)
        }
        Value::I32(_) | Value::U32(_) => {
            let x: Vec<i64> = a
                .iter()
                .map(|v| match v {
                    Value::I32(i) => *i as i64,
                    Value::U32(u) => *u as i64,
                    _ => 0,
                })
                .collect();
            let v = match f {
                Abs => x[0].abs(),
                Min => x[0].min(x[1]),
                Max => x[0].max(x[1]),
                Clamp if x[1] <= x[2] => x[0].clamp(x[1], x[2]),
                Sign => x[0].signum(),
                _ => return Err(format!("`{}` argument is out of its domain", f.wgsl())),
            };
            Ok(match a[0] {
                Value::I32(_) => {
                    Value::I32(i32::try_from(v).map_err(|_| "abs(i32::MIN) overflows".to_string())?)
                }
                _ => Value::U32(v as u32),
            })
        }
        _ => Err("unsupported constant operation".into()),
    }
}

fn convert(v: &Value, to: Scalar) -> Eval {
    let out_of_range = |x: f32| {
        Err(format!(
            "{x} does not convert to {} exactly in range",
            to.wgsl()
        ))
    };
    match (v, to) {
        (Value::Float(x, _), Scalar::F32 | Scalar::F16) => float(*x as f64, to),
        (Value::Float(x, _), Scalar::I32) if *x > -2147483904.0 && *x < 2147483648.0 => {
            Ok(Value::I32(*x as i32))
        }
        (Value::Float(x, _), Scalar::U32) if *x > -1.0 && *x < 4294967296.0 => {
            Ok(Value::U32(*x as u32))
        }
        (Value::Float(x, _), Scalar::I32 | Scalar::U32) => out_of_range(*x),
        (Value::Float(x, _), Scalar::Bool) => Ok(Value::Bool(*x != 0.0)),
        (Value::I32(i), _) => convert_int(*i as i64, *i as u32, to),
        (Value::U32(u), _) => convert_int(*u as i64, *u, to),
        (Value::Bool(b), _) => convert_int(*b as i64, *b as u32, to),
        (Value::Vector(_), _) => Err("unsupported constant conversion".into()),
    }
}

fn convert_int(value: i64, bits: u32, to: Scalar) -> Eval {
    match to {
        Scalar::F32 | Scalar::F16 => float(value as f32 as f64, to),
        Scalar::I32 => Ok(Value::I32(bits as i32)),
        Scalar::U32 => Ok(Value::U32(bits)),
        Scalar::Bool => Ok(Value::Bool(value != 0)),
    }
}

fn bitcast(v: &Value, to: Scalar) -> Eval {
    let bits = match v {
        Value::Float(x, Scalar::F32) => x.to_bits(),
        Value::I32(i) => *i as u32,
        Value::U32(u) => *u,
        _ => return Err("unsupported constant bitcast".into()),
    };
    match to {
        Scalar::F32 => float(f32::from_bits(bits) as f64, Scalar::F32),
        Scalar::I32 => Ok(Value::I32(bits as i32)),
        Scalar::U32 => Ok(Value::U32(bits)),
        _ => Err("unsupported constant bitcast".into()),
    }
}

fn construct(ty: &Ty, parts: Vec<Value>) -> Eval {
    match ty {
        Ty::Scalar(s) => convert(&parts[0], *s),
        Ty::Vector(n, s) => {
            let flat: Vec<Value> = parts
                .iter()
                .flat_map(|p| match p {
                    Value::Vector(c) => c.clone(),
                    s => vec![s.clone()],
                })
                .collect();
            let comps: Vec<Value> = if flat.len() == 1 {
                vec![flat[0].clone(); *n as usize]
            } else {
                flat
            };
            Ok(Value::Vector(
                comps
                    .iter()
                    .map(|c| convert(c, *s))
                    .collect::<Result<_, _>>()?,
            ))
        }
        Ty::Array(..) => Err("unsupported constant array".into()),
        Ty::CoopMatrix { .. } => Err("a cooperative matrix is not a constant".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounding() {
        assert_eq!(f16_round(1.0), 1.0);
        assert_eq!(f16_round(1.0 + 2f32.powi(-11)), 1.0); // tie to even
        assert_eq!(
            f16_round(1.0 + 3.0 * 2f32.powi(-11)),
            1.0 + 2.0 * 2f32.powi(-10)
        );
        assert_eq!(f16_round(0.1), 0.099975586);
    }

    #[test]
    fn left_shifts() {
        assert_eq!(shift_left(1, 31, 32, false), Ok(1 << 31));
        assert!(shift_left(3, 31, 32, false).is_err());
        assert!(shift_left(1, 31, 32, true).is_err()); // changes the sign
        assert_eq!(shift_left(u32::MAX as u64, 1, 32, true), Ok(0xffff_fffe)); // -1 << 1 = -2
        assert!(shift_left(1, 32, 32, false).is_err());
    }
}
