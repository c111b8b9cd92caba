//! # hesper-dsl-macros
//!
//! `#[kernel]` turns a Rust function into hesper-dsl builder calls, and `#[kernel_fn]` a helper
//! into a WGSL function. Thin sugar: the expansion is ordinary Rust calling the builder, which
//! stays the only semantics (as CubeCL's `#[cube]` does). See `hesper_dsl::kernel` for the
//! user-facing documentation; this crate is re-exported there.

use proc_macro::TokenStream;
use proc_macro_crate::{FoundCrate, crate_name};
use proc_macro2::{Span, TokenStream as Tokens};
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{
    BinOp, Block, Expr, ExprLit, FnArg, Ident, ItemFn, Lit, Meta, Pat, ReturnType, Stmt, Token,
    Type, UnOp,
};

/// Write a kernel as a Rust function: the function becomes a unit struct of the same name with
/// `key(shapes…)`, `body(&mut KernelBuilder)`, `build(shapes…)` and — where hesper-exec is a
/// dependency, directly or through `hesper` — a typed `launch(&mut Recorder, parameters in their order…, Grid)`, which takes
/// read buffers by `&GpuBuffer`, written ones by `&mut GpuBuffer`, and checks each `#[len(…)]`;
/// beside it, a struct `<Name>Launch` (`axpy` → `AxpyLaunch`) with the same parameters as named
/// fields, whose `.record(&mut rec, grid)` is `launch` without an argument order to get wrong.
///
/// ```text
/// #[kernel(workgroup_size = 256, subgroups, immediates, assume_in_bounds, name = "…")]  // all optional
/// fn name(
///     #[len(rows * cols)] x: &[f32],      // read-only storage buffer  (binding 0), at least
///                                         // rows·cols elements (checked by `launch`)
///     y: &mut [Vec4<f32>],                // read-write storage buffer (binding 1)
///     #[shape] cols: u32,                 // compile-time: keys the pipeline, plain Rust in the body
///     #[runtime] lr: f32,                 // per launch: uniform or immediates, an Expr in the body
///     #[workgroup] tile: &mut [f32; 256], // workgroup array (its length may use shapes)
/// ) { … }
/// ```
///
/// Options: `workgroup_size = 256`, `(16, 16)` or `(8, 8, 4)` (Rust over the shapes, like
/// `workgroup_size = wg`); `subgroups` (the key asks for `Features::SUBGROUPS`) or
/// `subgroups = use_sg` (a Rust `bool` over the shapes: one `#[kernel]` builds both variants and
/// keeps its typed launcher — `workgroup_reduce` picks the subgroup path by the key);
/// `immediates` (runtime scalars as immediates, not a uniform); `assume_in_bounds`;
/// `name = "…"` (the WGSL and key name, else the function's).
///
/// The body's vocabulary — everything else is a compile error at the offending code:
///
/// | write | means |
/// |---|---|
/// | `let v = e;` | a WGSL `let` when `e` is an expression (the name stays `v` in the WGSL), plain Rust when it is a Rust value |
/// | `let mut v = e;`, `v = e`, `v += e` | always a WGSL `var` (also from a Rust value: `let mut s = 0.0;`) and its updates (`+= -= *= /= %= &= \|= ^= <<= >>=`) |
/// | `x[i]`, `x[i] = e`, `x[i] += e`, `x.len()` | buffer and workgroup-array elements, a buffer's length (`arrayLength`) |
/// | `if c { … } else { … }` | comptime when `c` is a Rust `bool` (shapes, literals), WGSL when an expression |
/// | `for i in a..b`, `for i in (a..b).step_by(s)` | unrolled at build time over Rust bounds, a WGSL loop over expressions |
/// | `for i in grid_stride(n)` | each invocation takes `i = global_index(), + total_invocations(), …` below `n` |
/// | `for c in row_loop(len)` | the workgroup's invocations stride over `0..len` from their `local_index()` (the counter keeps your name) |
/// | `while c { … }`, `loop { … }`, `break`, `continue`, `return` | WGSL control flow |
/// | `+ - * / % & \| ^ << >> ! -`, `< <= > >= == !=`, `&& \|\|`, `e as f32` | on expressions and Rust values alike |
/// | `v.x`, `v.y`, `v.z`, `v.w`, `v.swizzle::<Vec2<f32>>("xy")` | vector components |
/// | `global_index()`, `workgroup_index()`, `total_invocations()`, `invocations()` | flat indices (right past 65535 workgroups) and the workgroup's size |
/// | `local_index()`, `global_id()`, `local_id()`, `workgroup_id()`, `num_workgroups()` | WGSL builtins |
/// | `workgroup_reduce(v, Reduce::Sum \| Max \| Min)` | every invocation gets the workgroup's sum, max or min (call it where all arrive; start a running max at `f32::MIN`, a min at `f32::MAX`: WGSL has no infinities) |
/// | `workgroup_barrier()`, `storage_barrier()` | barriers (checked to be in uniform control flow) |
/// | `workgroup_uniform_load(&tile[i])` | WGSL's `workgroupUniformLoad`: a barrier, the element, a barrier; every invocation gets one value, which counts as uniform (a branch on it may hold barriers) |
/// | `subgroup_add(v)`, `subgroup_max`, `subgroup_min`, `subgroup_shuffle_xor(v, m)`, `subgroup_broadcast(v, lane)`, `subgroup_size()`, `subgroup_invocation_id()`, `subgroup_id()`, `num_subgroups()` | subgroup operations (the key must ask for subgroups) |
/// | `max(a, b)`, `min`, `clamp(x, lo, hi)`, `abs`, `exp`, `exp2`, `log`, `log2`, `sqrt`, `inverse_sqrt`, `tanh`, `sin`, `cos`, `floor`, `ceil`, `pow(x, y)`, `fma(a, b, c)`, `select(c, if_true, if_false)` | WGSL builtins as functions |
/// | `x.exp()`, `x.sqrt()`, `x.max(y)`, `x.round()`, `x.fract()`, `x.sign()`, `a.dot(b)`, `a.mix(b, t)`, … | the same as methods (any `Expr` method) |
/// | `vec2(…)`, `vec3(…)`, `vec4(…)`, `lit(…)` | constructors |
/// | `helper(a, b)` | a [`macro@kernel_fn`] helper (a plain Rust function here is an error that says so) |
/// | `self::f(…)`, `u32::div_ceil(…)` | ordinary Rust, by a path, on Rust values |
///
/// Literals take their type from Rust: `2.0` is f32, `2u32` u32, a bare `2` is whichever
/// integer type the expression beside it has, and a bare `2` against an f32 expression is a
/// type error that says to write `2.0`. A misuse the types cannot catch (a barrier under a
/// per-invocation `if`, a shape missing from the key) is a `DslError` from `build` naming the
/// body's line.
///
/// Barriers, reductions and subgroup operations must be reached by every invocation together:
/// only conditions and loop bounds built from values all invocations share may surround them —
/// literals, shapes, runtime scalars, `workgroup_id()`, `workgroup_index()`,
/// `num_workgroups()`, reads of read-only buffers at such indices, and `let`s of those.
///
/// The launcher: `launch(&mut rec, <every parameter but #[workgroup] arrays, in declared
/// order>, grid)` — buffers, shapes and runtime scalars alike; `<Name>Launch` has the same
/// fields. One item per invocation: `Grid::Threads(n)` with `global_index()`; one workgroup
/// per row: `Grid::WorkgroupPerItem(rows)` with `workgroup_index()`; 2-D tiles of `TX×TY`:
/// `Grid::Workgroups([cols.div_ceil(TX), rows.div_ceil(TY), 1])` with `workgroup_id()` and
/// `local_id()`. The executor refuses a thread grid for the last two.
///
/// Precision: the builtins are the device's (`tanh`, `exp` to a few ulps); prefer forms that
/// do not cancel in f32, e.g. GELU's `0.5·x·(1 + tanh u)` as `x·sigmoid(2u)` (for u ≲ −8,
/// `1 + tanh u` is 0 in f32). Examples: `hesper_dsl`'s crate docs.
#[proc_macro_attribute]
pub fn kernel(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand_kernel(attr.into(), item.into())
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// Write a helper as a WGSL function, callable from `#[kernel]` bodies (and from other helpers):
///
/// ```text
/// #[kernel_fn]
/// fn silu(x: f32) -> f32 {
///     x / (1.0 + exp(-x))
/// }
/// ```
///
/// becomes `fn silu(k: &mut KernelBuilder, x: impl IntoExpr<f32>) -> Expr<f32>`, which declares
/// `fn silu(x: f32) -> f32` in the kernel once and calls it. The body ends with the returned
/// value; builtins (`global_index()`, …) are not available inside: pass them in.
#[proc_macro_attribute]
pub fn kernel_fn(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand_kernel_fn(attr.into(), item.into())
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// Where hesper-dsl and hesper-exec are, seen from the crate being compiled: as direct
/// dependencies, or through the `hesper` crate's re-exports. No exec crate: no launcher.
struct Paths {
    dsl: Tokens,
    exec: Option<Tokens>,
}

fn paths() -> Paths {
    let direct = |name: &str| match crate_name(name) {
        Ok(FoundCrate::Itself) => {
            let ident = Ident::new(&name.replace('-', "_"), Span::call_site());
            Some(quote!(::#ident))
        }
        Ok(FoundCrate::Name(n)) => {
            let ident = Ident::new(&n, Span::call_site());
            Some(quote!(::#ident))
        }
        Err(_) => None,
    };
    let umbrella = direct("hesper");
    let dsl = direct("hesper-dsl")
        .or_else(|| umbrella.as_ref().map(|h| quote!(#h::dsl)))
        .unwrap_or_else(|| quote!(::hesper_dsl));
    let exec = direct("hesper-exec").or_else(|| umbrella.as_ref().map(|h| quote!(#h::exec)));
    Paths { dsl, exec }
}

fn err<T>(span: Span, msg: impl std::fmt::Display) -> syn::Result<T> {
    Err(syn::Error::new(span, msg))
}

// ------------------------------------------------------------------ #[kernel]

struct Options {
    workgroup_size: Option<Expr>,
    name: Option<String>,
    /// `subgroups` (always) or `subgroups = expr` (a Rust `bool` over the shapes).
    subgroups: Option<Expr>,
    immediates: bool,
    assume_in_bounds: bool,
}

fn parse_options(attr: Tokens) -> syn::Result<Options> {
    let mut o = Options {
        workgroup_size: None,
        name: None,
        subgroups: None,
        immediates: false,
        assume_in_bounds: false,
    };
    let metas = Punctuated::<Meta, Token![,]>::parse_terminated.parse2(attr)?;
    for m in metas {
        match &m {
            Meta::Path(p) if p.is_ident("subgroups") => o.subgroups = Some(syn::parse_quote!(true)),
            Meta::NameValue(nv) if nv.path.is_ident("subgroups") => {
                o.subgroups = Some(nv.value.clone())
            }
            Meta::Path(p) if p.is_ident("immediates") => o.immediates = true,
            Meta::Path(p) if p.is_ident("assume_in_bounds") => o.assume_in_bounds = true,
            Meta::NameValue(nv) if nv.path.is_ident("workgroup_size") => {
                o.workgroup_size = Some(nv.value.clone())
            }
            Meta::NameValue(nv) if nv.path.is_ident("name") => match &nv.value {
                Expr::Lit(ExprLit {
                    lit: Lit::Str(s), ..
                }) => o.name = Some(s.value()),
                v => return err(v.span(), "`name` takes a string"),
            },
            _ => {
                return err(
                    m.span(),
                    "expected `workgroup_size = N` (or `(x, y)`, `(x, y, z)`), `name = \"…\"`, \
                     `subgroups` (or `subgroups = <bool over the shapes>`), `immediates` or \
                     `assume_in_bounds`",
                );
            }
        }
    }
    Ok(o)
}

/// What a kernel parameter is.
enum Param {
    /// `&[T]`: a read-only storage buffer, and the fewest elements the launcher accepts.
    Read(Type, Option<Expr>),
    /// `&mut [T]`: a read-write storage buffer, and the fewest elements the launcher accepts.
    Write(Type, Option<Expr>),
    /// `#[shape] n: u32`: a compile-time value that keys the pipeline.
    Shape(Type),
    /// `#[runtime] lr: f32`: a per-launch value (uniform or immediates).
    Runtime(Type),
    /// `#[workgroup] tile: &mut [T; N]`: a workgroup array.
    Workgroup(Type, Expr),
}

fn classify(arg: &syn::PatType) -> syn::Result<Param> {
    let marker = |name: &str| arg.attrs.iter().any(|a| a.path().is_ident(name));
    if let Some(a) = arg.attrs.iter().find(|a| {
        !["shape", "runtime", "workgroup", "len"]
            .iter()
            .any(|n| a.path().is_ident(n))
    }) {
        return err(
            a.span(),
            "kernel parameters take `#[shape]`, `#[runtime]`, `#[workgroup]` or (buffers) \
             `#[len(…)]`",
        );
    }
    let len = match arg.attrs.iter().find(|a| a.path().is_ident("len")) {
        Some(a) => Some((a.span(), a.parse_args::<Expr>()?)),
        None => None,
    };
    let ty = &*arg.ty;
    let buffer = |writable: bool, elem: &Type| {
        let len = len.clone().map(|(_, e)| e);
        match writable {
            true => Param::Write(elem.clone(), len),
            false => Param::Read(elem.clone(), len),
        }
    };
    let is_buffer = matches!(ty, Type::Reference(r) if matches!(&*r.elem, Type::Slice(_)));
    if let Some((span, _)) = &len
        && (!is_buffer || marker("workgroup"))
    {
        return err(
            *span,
            "`#[len(…)]` goes on a buffer parameter (`&[T]` or `&mut [T]`): the fewest elements \
             its launch accepts",
        );
    }
    if marker("shape") {
        return Ok(Param::Shape(ty.clone()));
    }
    if marker("runtime") {
        return Ok(Param::Runtime(ty.clone()));
    }
    if let Type::Reference(r) = ty {
        match (&*r.elem, r.mutability.is_some(), marker("workgroup")) {
            (Type::Slice(s), writable, false) => return Ok(buffer(writable, &s.elem)),
            (Type::Array(a), true, true) => {
                return Ok(Param::Workgroup((*a.elem).clone(), a.len.clone()));
            }
            _ => {}
        }
    }
    err(
        ty.span(),
        "a kernel parameter is `&[T]` (read-only buffer), `&mut [T]` (read-write buffer), \
         `#[shape] n: u32` (compile-time), `#[runtime] x: f32` (per launch) or \
         `#[workgroup] tile: &mut [T; N]`",
    )
}

fn is_type(ty: &Type, name: &str) -> bool {
    matches!(ty, Type::Path(p) if p.qself.is_none() && p.path.is_ident(name))
}

fn param_ident(arg: &syn::PatType) -> syn::Result<Ident> {
    match &*arg.pat {
        Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none() => Ok(p.ident.clone()),
        p => err(p.span(), "a kernel parameter is a plain name"),
    }
}

fn expand_kernel(attr: Tokens, item: Tokens) -> syn::Result<Tokens> {
    let options = parse_options(attr)?;
    let f: ItemFn = syn::parse2(item)?;
    let Paths { dsl, exec } = paths();
    if let ReturnType::Type(_, t) = &f.sig.output {
        return err(
            t.span(),
            "a kernel returns nothing: it writes its `&mut` buffers",
        );
    }
    if !f.sig.generics.params.is_empty() {
        return err(
            f.sig.generics.span(),
            "a kernel is not generic: make shapes `#[shape]` parameters",
        );
    }
    let name = &f.sig.ident;
    let vis = &f.vis;
    let kernel_name = options.name.clone().unwrap_or_else(|| name.to_string());

    let mut params = vec![];
    for input in &f.sig.inputs {
        let FnArg::Typed(arg) = input else {
            return err(input.span(), "a kernel takes no `self`");
        };
        params.push((param_ident(arg)?, classify(arg)?));
    }

    let mut tr = Translator::new(dsl.clone());
    let mut decls = vec![];
    let (mut shape_args, mut shape_names, mut key_shapes) = (vec![], vec![], vec![]);
    let (mut launch_args, mut bind_buffers, mut bind_params) = (vec![], vec![], vec![]);
    // The same parameters as the named fields of `<Name>Launch`.
    let (mut fields, mut field_names) = (vec![], vec![]);
    // Shapes first in the body: workgroup lengths and the workgroup size may use them.
    for (ident, p) in &params {
        if let Param::Shape(ty) = p {
            let s = ident.to_string();
            decls.push(quote!(let #ident: #ty = __k.shape::<#ty>(#s);));
            shape_args.push(quote!(#ident: #ty));
            shape_names.push(quote!(#ident));
            key_shapes.push(quote!(.shape(#s, #ident)));
            tr.declare(ident, Kind::Value);
        }
    }
    // A `#[len(…)]` is plain Rust over the shapes and runtime scalars, evaluated in u64 where
    // they are u32 (so `rows * cols` does not overflow).
    let widen: Vec<Tokens> = params
        .iter()
        .filter_map(|(ident, p)| match p {
            Param::Shape(ty) | Param::Runtime(ty) if is_type(ty, "u32") => {
                Some(quote!(let #ident = #ident as u64;))
            }
            _ => None,
        })
        .collect();
    // The launcher takes the parameters in their declared order.
    for (ident, p) in &params {
        let s = ident.to_string();
        match p {
            Param::Shape(ty) => {
                launch_args.push(quote!(#ident: #ty));
                fields.push(quote!(pub #ident: #ty));
                field_names.push(ident.clone());
            }
            Param::Read(elem, len) | Param::Write(elem, len) => {
                let writable = matches!(p, Param::Write(..));
                let declare = if writable {
                    quote!(storage_rw)
                } else {
                    quote!(storage)
                };
                decls.push(quote_spanned!(elem.span()=> let #ident = __k.#declare::<#elem>(#s);));
                tr.declare(ident, Kind::Buffer { writable });
                if let Some(exec) = &exec {
                    let host = quote_spanned!(elem.span()=> #exec::GpuBuffer<<#elem as #exec::HostElement>::Host>);
                    launch_args.push(if writable {
                        quote_spanned!(elem.span()=> #ident: &mut #host)
                    } else {
                        quote_spanned!(elem.span()=> #ident: &#host)
                    });
                    fields.push(if writable {
                        quote_spanned!(elem.span()=> pub #ident: &'a mut #host)
                    } else {
                        quote_spanned!(elem.span()=> pub #ident: &'a #host)
                    });
                    field_names.push(ident.clone());
                    bind_buffers.push(match len {
                        Some(len) => {
                            let rule = format!("#[len({})]", len.to_token_stream());
                            let at_least = quote_spanned!(len.span()=> {
                                #(#widen)*
                                (#len) as usize
                            });
                            quote!(.buffer_at_least_by(#s, &*#ident, #at_least, #rule))
                        }
                        None => quote!(.buffer_at_least(#s, &*#ident, 1)),
                    });
                }
            }
            Param::Runtime(ty) => {
                decls.push(quote_spanned!(ty.span()=> let #ident = __k.param::<#ty>(#s);));
                tr.declare(ident, Kind::Value);
                launch_args.push(quote!(#ident: #ty));
                fields.push(quote!(pub #ident: #ty));
                field_names.push(ident.clone());
                bind_params.push(quote!(.param(#s, #ident)));
            }
            Param::Workgroup(elem, len) => {
                decls.push(quote_spanned!(elem.span()=> let #ident = __k.workgroup_array::<#elem>(#s, (#len) as u32);));
                tr.declare(ident, Kind::Buffer { writable: true });
            }
        }
    }
    let body = tr.block_stmts(&f.block)?;

    let wg = match &options.workgroup_size {
        None => quote!(),
        // `(x, y)` or `(x, y, z)`: a 2-D or 3-D workgroup.
        Some(Expr::Tuple(t)) if (2..=3).contains(&t.elems.len()) => {
            let mut dims: Vec<Tokens> = t.elems.iter().map(|e| quote!((#e) as u32)).collect();
            dims.resize(3, quote!(1u32));
            quote!(.workgroup_size_3d([#(#dims),*]))
        }
        Some(Expr::Tuple(t)) => {
            return err(t.span(), "`workgroup_size` is `N`, `(x, y)` or `(x, y, z)`");
        }
        Some(e) => quote!(.workgroup_size(#e)),
    };
    let mut features = quote!(#dsl::Features::NONE);
    if let Some(when) = &options.subgroups {
        features = quote!(#features | if #when { #dsl::Features::SUBGROUPS } else { #dsl::Features::NONE });
    }
    if options.immediates {
        features = quote!(#features | #dsl::Features::IMMEDIATES);
    }
    let in_bounds = if options.assume_in_bounds {
        quote!(.assume_in_bounds())
    } else {
        quote!()
    };
    let doc = format!(
        "The kernel `{kernel_name}` (written with `#[kernel]`): `key`, `body` and `build` make it; \
         `launch` records a typed launch."
    );
    let launch_struct = format_ident!("{}Launch", camel_case(&name.to_string()));
    let has_buffers = params
        .iter()
        .any(|(_, p)| matches!(p, Param::Read(..) | Param::Write(..)));
    let (lifetime, elided) = if has_buffers {
        (quote!(<'a>), quote!(<'_>))
    } else {
        (quote!(), quote!())
    };
    let named_launcher = exec.as_ref().map(|exec| {
        let doc = format!(
            "The parameters of the kernel [`{name}`], by name: `{launch_struct} {{ … }}.record(&mut rec, grid)` \
             is [`{name}::launch`] with no argument order to get wrong."
        );
        let record_doc = format!("Record the launch: [`{name}::launch`] with these parameters.");
        quote! {
            #[doc = #doc]
            #vis struct #launch_struct #lifetime {
                #(#fields,)*
            }

            impl #launch_struct #elided {
                #[doc = #record_doc]
                #vis fn record(
                    self,
                    rec: &mut #exec::Recorder<'_>,
                    grid: #exec::Grid,
                ) -> ::core::result::Result<(), #exec::ExecError> {
                    let Self { #(#field_names),* } = self;
                    #name::launch(rec, #(#field_names,)* grid)
                }
            }
        }
    });
    let launcher = exec.map(|exec| {
        quote! {
            /// Record one launch, its parameters in the kernel's order (written buffers by
            /// `&mut`): the kernel comes from the device's pipeline cache (compiled once per
            /// shape); buffers bind by parameter name, must have the parameters' element types
            /// and at least the elements their `#[len(…)]` says (else one), checked before
            /// anything is recorded.
            #[allow(clippy::too_many_arguments)]
            pub fn launch(
                __rec: &mut #exec::Recorder<'_>,
                #(#launch_args,)*
                __grid: #exec::Grid,
            ) -> ::core::result::Result<(), #exec::ExecError> {
                let __compiled = __rec.gpu().kernel(&Self::key(#(#shape_names),*), Self::body)?;
                let __args = #exec::Args::new() #(#bind_buffers)* #(#bind_params)*;
                __rec.launch(&__compiled, &__args, __grid)
            }
        }
    });
    let user_attrs = &f.attrs;
    Ok(quote! {
        #[doc = #doc]
        #(#user_attrs)*
        #[allow(non_camel_case_types)]
        #vis struct #name;

        #named_launcher

        #[allow(unused_variables, unused_mut, clippy::all)]
        impl #name {
            /// The kernel's name.
            pub const NAME: &'static str = #kernel_name;

            /// The key: name, shape parameters, features and workgroup size.
            pub fn key(#(#shape_args),*) -> #dsl::KernelKey {
                #dsl::KernelKey::new(#kernel_name) #wg #(#key_shapes)* .features(#features) #in_bounds
            }

            /// Record the kernel into a builder (shape values are read from its key).
            pub fn body(__k: &mut #dsl::KernelBuilder) {
                #(#decls)*
                #body
            }

            /// Build and validate the kernel for these shapes.
            pub fn build(#(#shape_args),*) -> ::core::result::Result<#dsl::Kernel, #dsl::DslError> {
                #dsl::Kernel::build(&Self::key(#(#shape_names),*), Self::body)
            }

            #launcher
        }
    })
}

// ------------------------------------------------------------------ #[kernel_fn]

fn expand_kernel_fn(attr: Tokens, item: Tokens) -> syn::Result<Tokens> {
    if !attr.is_empty() {
        return err(attr.span(), "`#[kernel_fn]` takes no arguments");
    }
    let f: ItemFn = syn::parse2(item)?;
    let Paths { dsl, .. } = paths();
    let name = &f.sig.ident;
    let vis = &f.vis;
    let ReturnType::Type(_, ret) = &f.sig.output else {
        return err(
            f.sig.span(),
            "a `#[kernel_fn]` returns a value (WGSL functions here do)",
        );
    };
    let mut tr = Translator::new(dsl.clone());
    let (mut idents, mut tys, mut names) = (vec![], vec![], vec![]);
    for input in &f.sig.inputs {
        let FnArg::Typed(arg) = input else {
            return err(input.span(), "a `#[kernel_fn]` takes no `self`");
        };
        let ident = param_ident(arg)?;
        tr.declare(&ident, Kind::Value);
        names.push(ident.to_string());
        tys.push((*arg.ty).clone());
        idents.push(ident);
    }
    let Some((last, init)) = f.block.stmts.split_last() else {
        return err(
            f.block.span(),
            "a `#[kernel_fn]` body ends with the value it returns",
        );
    };
    let Stmt::Expr(value, None) = last else {
        return err(
            last.span(),
            "a `#[kernel_fn]` body ends with the value it returns (no `;`)",
        );
    };
    let mut stmts = Tokens::new();
    for s in init {
        stmts.extend(tr.stmt(s)?);
    }
    let value = tr.expr(value)?;
    let fname = name.to_string();
    Ok(quote! {
        #vis fn #name(__k: &mut #dsl::KernelBuilder, #(#idents: impl #dsl::IntoExpr<#tys>),*) -> #dsl::Expr<#ret> {
            let __f = __k.function::<(#(#tys,)*), #ret>(#fname, &[#(#names),*], |__k, (#(#idents,)*)| {
                #stmts
                #value
            });
            __f.call((#(#dsl::IntoExpr::<#tys>::into_expr(#idents),)*))
        }
    })
}

// ------------------------------------------------------------------ the body

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// A storage buffer or workgroup array: indexed, never used as a value.
    Buffer { writable: bool },
    /// A DSL `var` (`let mut`): read with `.get()`, assigned through the builder.
    Var,
    /// An expression or a Rust value: cloned where used.
    Value,
}

struct Translator {
    dsl: Tokens,
    scopes: Vec<Vec<(String, Kind)>>,
}

/// Builder methods a body calls as functions.
const BUILDER_CALLS: &[&str] = &[
    "global_index",
    "workgroup_index",
    "total_invocations",
    "local_index",
    "global_id",
    "local_id",
    "workgroup_id",
    "num_workgroups",
    "subgroup_size",
    "subgroup_invocation_id",
    "subgroup_id",
    "num_subgroups",
    "subgroup_add",
    "subgroup_max",
    "subgroup_min",
    "subgroup_shuffle_xor",
    "subgroup_broadcast",
    "workgroup_reduce",
    "workgroup_barrier",
    "storage_barrier",
    "invocations",
];
/// WGSL builtins written as free functions.
const MATH_CALLS: &[&str] = &[
    "max",
    "min",
    "clamp",
    "abs",
    "exp",
    "exp2",
    "log",
    "log2",
    "sqrt",
    "inverse_sqrt",
    "tanh",
    "sin",
    "cos",
    "floor",
    "ceil",
    "pow",
    "fma",
    "select",
];
/// Constructors from the DSL's root.
const ROOT_CALLS: &[&str] = &["vec2", "vec3", "vec4", "lit"];

fn single_ident(e: &Expr) -> Option<&Ident> {
    match e {
        Expr::Path(p) if p.qself.is_none() => p.path.get_ident(),
        _ => None,
    }
}

impl Translator {
    fn new(dsl: Tokens) -> Self {
        Translator {
            dsl,
            scopes: vec![vec![]],
        }
    }

    fn declare(&mut self, ident: &Ident, kind: Kind) {
        self.scopes
            .last_mut()
            .expect("a scope is always open")
            .push((ident.to_string(), kind));
    }

    fn kind(&self, ident: &Ident) -> Kind {
        let name = ident.to_string();
        self.scopes
            .iter()
            .rev()
            .flat_map(|s| s.iter().rev())
            .find(|(n, _)| *n == name)
            .map(|(_, k)| *k)
            .unwrap_or(Kind::Value)
    }

    fn scoped<T>(&mut self, f: impl FnOnce(&mut Self) -> syn::Result<T>) -> syn::Result<T> {
        self.scopes.push(vec![]);
        let r = f(self);
        self.scopes.pop();
        r
    }

    /// A block's statements, in a scope of their own, as a `{ … }` body.
    fn block_stmts(&mut self, b: &Block) -> syn::Result<Tokens> {
        self.scoped(|t| {
            let mut out = Tokens::new();
            for s in &b.stmts {
                out.extend(t.stmt(s)?);
            }
            Ok(out)
        })
    }

    fn stmt(&mut self, s: &Stmt) -> syn::Result<Tokens> {
        match s {
            Stmt::Local(local) => self.local(local),
            Stmt::Expr(e, _) => self.stmt_expr(e),
            Stmt::Item(item) => Ok(quote!(#item)),
            Stmt::Macro(m) => Ok(quote!(#m)),
        }
    }

    fn local(&mut self, local: &syn::Local) -> syn::Result<Tokens> {
        let (pat, ty) = match &local.pat {
            Pat::Type(pt) => (&*pt.pat, Some(&*pt.ty)),
            p => (p, None),
        };
        let Pat::Ident(pi) = pat else {
            return err(pat.span(), "bind one name per `let` in a kernel body");
        };
        let ident = &pi.ident;
        let hint = ident.to_string();
        let Some(init) = &local.init else {
            return err(
                local.span(),
                "give the variable its first value: `let mut x = 0.0;`",
            );
        };
        if init.diverge.is_some() {
            return err(
                init.expr.span(),
                "`let … else` is not supported in a kernel body",
            );
        }
        let span = init.expr.span();
        let value = (self.expr(&init.expr)?, span);
        if pi.mutability.is_some() {
            let turbofish = ty.map(|t| quote!(::<#t>));
            self.declare(ident, Kind::Var);
            let make = with_temps(vec![value], |a| {
                let v = &a[0];
                quote_spanned!(span=> __k.var #turbofish (#hint, #v))
            });
            return Ok(quote!(let #ident = #make;));
        }
        self.declare(ident, Kind::Value);
        let dsl = &self.dsl;
        let annotated = ty.map(|t| quote!(: #t));
        let make = with_temps(vec![value], |a| {
            let v = &a[0];
            let dsl = respan(dsl, span);
            quote_spanned!(span=> #dsl::macro_support::Bind::bind(#v, __k, #hint))
        });
        Ok(quote!(let #ident #annotated = #make;))
    }

    /// An expression in statement position: assignments and control flow become builder calls.
    fn stmt_expr(&mut self, e: &Expr) -> syn::Result<Tokens> {
        let dsl = self.dsl.clone();
        let span = e.span();
        match e {
            Expr::Assign(a) => self.assign(&a.left, None, &a.right),
            Expr::Binary(b) if compound_op(&b.op).is_some() => {
                self.assign(&b.left, compound_op(&b.op), &b.right)
            }
            Expr::If(i) => self.if_stmt(i),
            Expr::ForLoop(f) => {
                let Pat::Ident(pi) = &*f.pat else {
                    return err(f.pat.span(), "a kernel `for` binds one name");
                };
                let ident = &pi.ident;
                let hint = ident.to_string();
                // `for i in grid_stride(n)` and `for c in row_loop(len)`: the combinators.
                if let Expr::Call(c) = &*f.expr
                    && let Some(name) = single_ident(&c.func)
                    && (name == "grid_stride" || name == "row_loop")
                {
                    let [len] = c.args.iter().collect::<Vec<_>>()[..] else {
                        return err(c.span(), format!("`{name}` takes one length: `{name}(n)`"));
                    };
                    let len = (self.bound(len)?, len.span());
                    let body = self.scoped(|t| {
                        t.declare(ident, Kind::Value);
                        t.block_stmts(&f.body)
                    })?;
                    let method = format_ident!("{}_as", name);
                    return Ok(with_temps(vec![len], |a| {
                        let n = &a[0];
                        quote_spanned!(span=> __k.#method(#hint, #n, |__k, #ident| { #body });)
                    }));
                }
                let (range, step) = match &*f.expr {
                    Expr::MethodCall(m) if m.method == "step_by" && m.args.len() == 1 => {
                        (strip_parens(&m.receiver), Some(&m.args[0]))
                    }
                    other => (other, None),
                };
                let Expr::Range(r) = range else {
                    return err(
                        f.expr.span(),
                        "a kernel `for` runs over `a..b`, `(a..b).step_by(s)`, `grid_stride(n)` \
                         or `row_loop(len)`",
                    );
                };
                let (Some(start), Some(end), syn::RangeLimits::HalfOpen(_)) =
                    (&r.start, &r.end, &r.limits)
                else {
                    return err(
                        r.span(),
                        "a kernel `for` range is `a..b` (both ends given, end excluded)",
                    );
                };
                let (start, end) = (
                    (self.bound(start)?, start.span()),
                    (self.bound(end)?, end.span()),
                );
                let body = self.scoped(|t| {
                    t.declare(ident, Kind::Value);
                    t.block_stmts(&f.body)
                })?;
                match step {
                    Some(s) => {
                        let s = (self.bound(s)?, s.span());
                        Ok(with_temps(vec![start, end, s], |a| {
                            let (a0, a1, a2) = (&a[0], &a[1], &a[2]);
                            let dsl = respan(&dsl, span);
                            quote_spanned!(span=>
                                #dsl::macro_support::for_range_step(__k, #hint, (#a0, #a1), #a2, |__k, #ident| { #body });)
                        }))
                    }
                    None => Ok(with_temps(vec![start, end], |a| {
                        let (a0, a1) = (&a[0], &a[1]);
                        let dsl = respan(&dsl, span);
                        quote_spanned!(span=>
                            #dsl::macro_support::for_range(__k, #hint, (#a0, #a1), |__k, #ident| { #body });)
                    })),
                }
            }
            Expr::While(w) => {
                let cond = (self.expr(&w.cond)?, w.cond.span());
                let body = self.block_stmts(&w.body)?;
                Ok(with_temps(vec![cond], |a| {
                    let c = &a[0];
                    quote_spanned!(span=> __k.while_(#c, |__k| { #body });)
                }))
            }
            Expr::Loop(l) => {
                let body = self.block_stmts(&l.body)?;
                Ok(quote_spanned!(span=> __k.loop_(|__k| { #body });))
            }
            Expr::Break(b) if b.label.is_none() && b.expr.is_none() => {
                Ok(quote_spanned!(span=> __k.break_();))
            }
            Expr::Continue(c) if c.label.is_none() => Ok(quote_spanned!(span=> __k.continue_();)),
            Expr::Return(r) if r.expr.is_none() => Ok(quote_spanned!(span=> __k.return_();)),
            Expr::Block(b) => {
                let body = self.block_stmts(&b.block)?;
                Ok(quote!({ #body }))
            }
            Expr::Macro(m) => Ok(quote!(#m;)),
            _ => {
                let value = self.expr(e)?;
                Ok(quote_spanned!(span=> #value;))
            }
        }
    }

    fn if_stmt(&mut self, i: &syn::ExprIf) -> syn::Result<Tokens> {
        let dsl = self.dsl.clone();
        let cond = (self.expr(&i.cond)?, i.cond.span());
        let then = self.block_stmts(&i.then_branch)?;
        let otherwise = match &i.else_branch {
            None => Tokens::new(),
            Some((_, e)) => match &**e {
                Expr::If(inner) => self.if_stmt(inner)?,
                Expr::Block(b) => self.block_stmts(&b.block)?,
                other => return err(other.span(), "an `else` takes a block or another `if`"),
            },
        };
        Ok(with_temps(vec![cond], |a| {
            let c = &a[0];
            let dsl = respan(&dsl, i.span());
            quote_spanned!(i.span()=> #dsl::macro_support::if_else(__k, #c, |__k| { #then }, |__k| { #otherwise });)
        }))
    }

    /// `target = value` or `target op= value`.
    fn assign(&mut self, target: &Expr, op: Option<Tokens>, value: &Expr) -> syn::Result<Tokens> {
        let span = target.span();
        let value = (self.expr(value)?, value.span());
        let target = strip_parens(target);
        if let Some(ident) = single_ident(target) {
            return match (self.kind(ident), op) {
                (Kind::Var, None) => Ok(with_temps(vec![value], |a| {
                    let v = &a[0];
                    quote_spanned!(span=> __k.assign(&#ident, #v);)
                })),
                (Kind::Var, Some(op)) => Ok(with_temps(vec![value], |a| {
                    let v = &a[0];
                    quote_spanned!(span=> __k.update(&#ident, #op, #v);)
                })),
                (Kind::Buffer { .. }, _) => err(
                    target.span(),
                    format!("assign to an element: `{ident}[i] = …`"),
                ),
                (Kind::Value, _) => err(
                    target.span(),
                    format!(
                        "cannot assign to `{ident}`: declare it `let mut {ident} = …` to make it a variable"
                    ),
                ),
            };
        }
        if let Expr::Index(ix) = target
            && let Some(base) = single_ident(&ix.expr)
            && let Kind::Buffer { writable } = self.kind(base)
        {
            if !writable {
                return err(
                    ix.expr.span(),
                    format!(
                        "cannot write to `{base}`: it is a read-only buffer (`&[T]`); declare it `&mut [T]`"
                    ),
                );
            }
            let index = (self.expr(&ix.index)?, ix.index.span());
            return Ok(with_temps(vec![index, value], |a| {
                let (i, v) = (&a[0], &a[1]);
                match op {
                    None => quote_spanned!(span=> __k.store(&#base, #i, #v);),
                    Some(op) => quote_spanned!(span=> __k.store_op(&#base, #i, #op, #v);),
                }
            }));
        }
        err(
            target.span(),
            "assign to a `let mut` variable or to a `&mut` buffer element",
        )
    }

    /// A `for` bound or step: unsuffixed integer literals are u32 (indices are).
    fn bound(&mut self, e: &Expr) -> syn::Result<Tokens> {
        if let Expr::Lit(ExprLit {
            lit: Lit::Int(i), ..
        }) = e
            && i.suffix().is_empty()
        {
            let v = syn::LitInt::new(&format!("{}u32", i.base10_digits()), i.span());
            return Ok(quote!(#v));
        }
        self.expr(e)
    }

    /// An expression in value position.
    fn expr(&mut self, e: &Expr) -> syn::Result<Tokens> {
        let dsl = self.dsl.clone();
        let ms = quote!(#dsl::macro_support);
        let span = e.span();
        Ok(match e {
            Expr::Lit(ExprLit {
                lit: Lit::Float(f), ..
            }) if f.suffix().is_empty() => {
                let v = syn::LitFloat::new(&format!("{}f32", f.base10_digits()), f.span());
                quote!(#v)
            }
            Expr::Lit(l) => quote!(#l),
            Expr::Path(p) => match p.path.get_ident() {
                Some(ident) if p.qself.is_none() => match self.kind(ident) {
                    Kind::Var => quote_spanned!(span=> #ident.get()),
                    Kind::Buffer { .. } => {
                        return err(
                            span,
                            format!("`{ident}` is a buffer: read an element with `{ident}[i]`"),
                        );
                    }
                    Kind::Value => quote_spanned!(span=> ::core::clone::Clone::clone(&#ident)),
                },
                _ => quote!(#p),
            },
            Expr::Paren(p) => {
                let inner = self.expr(&p.expr)?;
                quote!((#inner))
            }
            Expr::Binary(b) => {
                let (l, r) = (self.expr(&b.left)?, self.expr(&b.right)?);
                let method = |m: &str| Ident::new(m, b.op.span());
                match &b.op {
                    BinOp::Lt(_)
                    | BinOp::Le(_)
                    | BinOp::Gt(_)
                    | BinOp::Ge(_)
                    | BinOp::Eq(_)
                    | BinOp::Ne(_) => {
                        let m = method(match &b.op {
                            BinOp::Lt(_) => "lt",
                            BinOp::Le(_) => "le",
                            BinOp::Gt(_) => "gt",
                            BinOp::Ge(_) => "ge",
                            BinOp::Eq(_) => "eq",
                            _ => "ne",
                        });
                        quote_spanned!(span=> #ms::Compare::#m(#l, #r))
                    }
                    BinOp::And(_) => quote_spanned!(span=> #ms::Logic::and(#l, #r)),
                    BinOp::Or(_) => quote_spanned!(span=> #ms::Logic::or(#l, #r)),
                    op if compound_op(op).is_some() => {
                        return err(span, "`op=` is a statement: write it on its own line");
                    }
                    op => group(quote_spanned!(span=> #l #op #r)),
                }
            }
            Expr::Unary(u) => {
                let inner = self.expr(&u.expr)?;
                match u.op {
                    UnOp::Neg(_) => group(quote_spanned!(span=> -#inner)),
                    UnOp::Not(_) => group(quote_spanned!(span=> !#inner)),
                    _ => return err(span, "`*` is not supported in a kernel body"),
                }
            }
            Expr::Index(ix) => {
                let index = self.expr(&ix.index)?;
                match single_ident(&ix.expr) {
                    Some(base) if matches!(self.kind(base), Kind::Buffer { .. }) => {
                        quote_spanned!(span=> #dsl::Indexable::at(&#base, #index))
                    }
                    _ => {
                        let base = self.expr(&ix.expr)?;
                        quote_spanned!(span=> #base.component(#index))
                    }
                }
            }
            Expr::Call(c)
                if single_ident(&c.func).is_some_and(|f| f == "workgroup_uniform_load") =>
            {
                // WGSL's spelling, `workgroup_uniform_load(&tile[i])`: one workgroup array's
                // element (the builder's type says which arrays are).
                let place = match (c.args.len(), c.args.first()) {
                    (1, Some(Expr::Reference(r))) => &*r.expr,
                    _ => {
                        return err(
                            span,
                            "write `workgroup_uniform_load(&tile[i])`: a reference to one element \
                             of a `#[workgroup]` array",
                        );
                    }
                };
                let base = match place {
                    Expr::Index(ix) => single_ident(&ix.expr)
                        .filter(|b| matches!(self.kind(b), Kind::Buffer { .. }))
                        .map(|b| (b, ix)),
                    _ => None,
                };
                let Some((base, ix)) = base else {
                    return err(
                        place.span(),
                        "`workgroup_uniform_load` reads one element of a `#[workgroup]` array: \
                         write `&tile[i]`",
                    );
                };
                let index = (self.expr(&ix.index)?, ix.index.span());
                with_temps(vec![index], |a| {
                    let i = &a[0];
                    quote_spanned!(span=> __k.workgroup_uniform_load("uniform", &#base, #i))
                })
            }
            Expr::Call(c) => {
                let args = c
                    .args
                    .iter()
                    .map(|a| Ok((self.expr(a)?, a.span())))
                    .collect::<syn::Result<Vec<_>>>()?;
                match single_ident(&c.func) {
                    Some(f) if BUILDER_CALLS.contains(&f.to_string().as_str()) => {
                        with_temps(args, |a| quote_spanned!(span=> __k.#f(#(#a),*)))
                    }
                    Some(f) if MATH_CALLS.contains(&f.to_string().as_str()) => {
                        let args = args.iter().map(|(t, _)| t);
                        quote_spanned!(span=> #ms::#f(#(#args),*))
                    }
                    Some(f) if ROOT_CALLS.contains(&f.to_string().as_str()) => {
                        let args = args.iter().map(|(t, _)| t);
                        quote_spanned!(span=> #dsl::#f(#(#args),*))
                    }
                    // Any other plain name is a `#[kernel_fn]` helper; call other Rust functions
                    // by a path (`self::f`, `u32::div_ceil`).
                    Some(f) => with_temps(args, |a| {
                        let ms = respan(&ms, span);
                        quote_spanned!(span=> #ms::call_kernel_fn(#f, __k, (#(#a,)*)))
                    }),
                    None => {
                        let func = &c.func;
                        let args = args.iter().map(|(t, _)| t);
                        quote_spanned!(span=> #func(#(#args),*))
                    }
                }
            }
            Expr::MethodCall(m) => {
                let receiver = match single_ident(&m.receiver) {
                    // Buffer methods (`len`) take the handle itself.
                    Some(base) if matches!(self.kind(base), Kind::Buffer { .. }) => quote!(#base),
                    _ => self.expr(&m.receiver)?,
                };
                let args = m
                    .args
                    .iter()
                    .map(|a| self.expr(a))
                    .collect::<syn::Result<Vec<_>>>()?;
                let (method, turbofish) = (&m.method, &m.turbofish);
                quote_spanned!(span=> #receiver.#method #turbofish (#(#args),*))
            }
            Expr::Cast(c) => {
                let inner = self.expr(&c.expr)?;
                let ty = &c.ty;
                quote_spanned!(span=> #ms::cast::<#ty, _>(#inner))
            }
            Expr::Field(f) => {
                let base = self.expr(&f.base)?;
                match &f.member {
                    syn::Member::Named(n)
                        if ["x", "y", "z", "w"].contains(&n.to_string().as_str()) =>
                    {
                        quote_spanned!(span=> #base.#n())
                    }
                    m => {
                        return err(
                            m.span(),
                            "a kernel reads vector components as `.x`, `.y`, `.z`, `.w`; for more, use `.swizzle::<Vec2<f32>>(\"xy\")`",
                        );
                    }
                }
            }
            Expr::If(_) => {
                return err(
                    span,
                    "`if` as a value: use `select(cond, if_true, if_false)`",
                );
            }
            Expr::Match(_) => {
                return err(span, "`match` is not supported in a kernel body: use `if`");
            }
            Expr::Closure(_) => return err(span, "closures are not supported in a kernel body"),
            Expr::Reference(_) => return err(span, "references are not needed in a kernel body"),
            _ => return err(span, "this expression is not supported in a kernel body"),
        })
    }
}

/// `{ let __a0 = a0; …; make([__a0, …]) }`: arguments that may call helpers (which borrow the
/// builder) are evaluated before the builder call borrows it.
/// Each temporary carries its expression's span, so a type error points at the user's code.
fn with_temps(args: Vec<(Tokens, Span)>, make: impl FnOnce(&[Ident]) -> Tokens) -> Tokens {
    let names: Vec<Ident> = args
        .iter()
        .enumerate()
        .map(|(i, (_, span))| format_ident!("__a{}", i, span = *span))
        .collect();
    let values = args.iter().map(|(t, _)| t);
    let call = make(&names);
    quote!({ #(let #names = #values;)* #call })
}

/// `row_sum` → `RowSum`.
fn camel_case(snake: &str) -> String {
    snake
        .split('_')
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|first| first.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

/// `tokens` placed at `span`: a call's place (what `#[track_caller]` reports) is its path's
/// span, and a path built at the attribute would place the call at `#[kernel]`.
fn respan(tokens: &Tokens, span: Span) -> Tokens {
    tokens
        .clone()
        .into_iter()
        .map(|mut t| {
            if let proc_macro2::TokenTree::Group(g) = &t {
                let mut inner = proc_macro2::Group::new(g.delimiter(), respan(&g.stream(), span));
                inner.set_span(span);
                t = proc_macro2::TokenTree::Group(inner);
            }
            t.set_span(span);
            t
        })
        .collect()
}

/// Tokens kept together as the parser grouped them, without parentheses (which would warn).
fn group(tokens: Tokens) -> Tokens {
    let g = proc_macro2::Group::new(proc_macro2::Delimiter::None, tokens);
    quote!(#g)
}

fn strip_parens(e: &Expr) -> &Expr {
    match e {
        Expr::Paren(p) => strip_parens(&p.expr),
        _ => e,
    }
}

/// The DSL operator of a compound assignment (`+=` → `BinaryOp::Add`).
fn compound_op(op: &BinOp) -> Option<Tokens> {
    let name = match op {
        BinOp::AddAssign(_) => "Add",
        BinOp::SubAssign(_) => "Sub",
        BinOp::MulAssign(_) => "Mul",
        BinOp::DivAssign(_) => "Div",
        BinOp::RemAssign(_) => "Rem",
        BinOp::BitAndAssign(_) => "BitAnd",
        BinOp::BitOrAssign(_) => "BitOr",
        BinOp::BitXorAssign(_) => "BitXor",
        BinOp::ShlAssign(_) => "Shl",
        BinOp::ShrAssign(_) => "Shr",
        _ => return None,
    };
    let ident = format_ident!("{}", name);
    let Paths { dsl, .. } = paths();
    Some(quote!(#dsl::BinaryOp::#ident))
}
