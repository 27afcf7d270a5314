//! What a step needs to know of a caller's tensor (a torch.Tensor or a numpy.ndarray), read without a copy:
//! data pointer, shape, strides in elements, element type and device. The checks every argument goes through
//! before anything is read or written live here too, each error naming the argument.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use pyo3::{intern, Py};

/// Dimensions a step's tensors have at most.
pub const MAX_DIM: usize = 4;

/// An element type a step's tensors may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    Bf16,
    F16,
    I32,
    /// Any other (its name is read from the object when an error reports it).
    Other,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::F32 | Elem::I32 => 4,
            Elem::Bf16 | Elem::F16 => 2,
            Elem::Other => 1,
        }
    }
    pub fn dtype(self) -> Option<gdn::DType> {
        match self {
            Elem::F32 => Some(gdn::DType::F32),
            Elem::Bf16 => Some(gdn::DType::Bf16),
            Elem::F16 => Some(gdn::DType::F16),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// A CUDA device by its ordinal.
    Cuda(i64),
    /// Any other (meta, mps, ...).
    Other,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Other => write!(f, "a device gdn does not run on"),
        }
    }
}

/// A tensor as the step sees it. Strides are in elements.
pub struct View<'py> {
    pub name: &'static str,
    pub obj: Bound<'py, PyAny>,
    pub ptr: usize,
    pub ndim: usize,
    pub shape: [usize; MAX_DIM],
    pub strides: [isize; MAX_DIM],
    pub elem: Elem,
    pub device: Device,
    pub readonly: bool,
}

/// Python objects looked up once: numpy's array type, torch's tensor type and dtypes (once torch is imported).
pub struct Types {
    ndarray: Py<PyType>,
}
pub struct Torch {
    tensor: Py<PyType>,
    f32: Py<PyAny>,
    bf16: Py<PyAny>,
    f16: Py<PyAny>,
    i32: Py<PyAny>,
}

static TYPES: PyOnceLock<Types> = PyOnceLock::new();
static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

fn types(py: Python<'_>) -> PyResult<&'static Types> {
    TYPES.get_or_try_init(py, || {
        let np = py.import("numpy")?;
        Ok(Types {
            ndarray: np.getattr("ndarray")?.cast_into::<PyType>()?.unbind(),
        })
    })
}

/// torch's types, where torch is imported already (gdn never imports it: a numpy user need not have it).
pub fn torch(py: Python<'_>) -> PyResult<Option<&'static Torch>> {
    if let Some(t) = TORCH.get(py) {
        return Ok(Some(t));
    }
    let modules = py.import("sys")?.getattr("modules")?;
    let Some(torch) = modules.cast::<PyDict>()?.get_item("torch")? else {
        return Ok(None);
    };
    let t = TORCH.get_or_try_init(py, || {
        Ok::<_, PyErr>(Torch {
            tensor: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
            f32: torch.getattr("float32")?.unbind(),
            bf16: torch.getattr("bfloat16")?.unbind(),
            f16: torch.getattr("float16")?.unbind(),
            i32: torch.getattr("int32")?.unbind(),
        })
    })?;
    Ok(Some(t))
}

impl Torch {
    pub fn is_tensor(&self, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
        obj.is_instance(self.tensor.bind(obj.py()))
    }
}

fn small_tuple(
    name: &'static str,
    what: &str,
    t: &Bound<'_, PyAny>,
) -> PyResult<(usize, [isize; MAX_DIM])> {
    let t = t.cast::<PyTuple>()?;
    let n = t.len();
    if n > MAX_DIM {
        return Err(PyValueError::new_err(format!(
            "{name} has {n} dimensions; no argument of gdn.step has more than {MAX_DIM}"
        )));
    }
    let mut out = [0isize; MAX_DIM];
    for (i, x) in t.iter().enumerate() {
        out[i] = x
            .extract()
            .map_err(|_| PyValueError::new_err(format!("{name}: bad {what}")))?;
    }
    Ok((n, out))
}

impl<'py> View<'py> {
    /// The view of `obj`, a torch.Tensor or a numpy.ndarray.
    pub fn of(name: &'static str, obj: &Bound<'py, PyAny>) -> PyResult<View<'py>> {
        let py = obj.py();
        if let Some(t) = torch(py)? {
            if t.is_tensor(obj)? {
                return Self::of_torch(name, obj, t);
            }
        }
        if obj.is_instance(types(py)?.ndarray.bind(py))? {
            return Self::of_numpy(name, obj);
        }
        Err(PyTypeError::new_err(format!(
            "{name} must be a torch.Tensor or a numpy.ndarray, got {}",
            obj.get_type().name()?
        )))
    }

    fn of_torch(name: &'static str, obj: &Bound<'py, PyAny>, t: &Torch) -> PyResult<View<'py>> {
        let py = obj.py();
        let dtype = obj.getattr(intern!(py, "dtype"))?;
        let elem = if dtype.is(t.f32.bind(py)) {
            Elem::F32
        } else if dtype.is(t.bf16.bind(py)) {
            Elem::Bf16
        } else if dtype.is(t.f16.bind(py)) {
            Elem::F16
        } else if dtype.is(t.i32.bind(py)) {
            Elem::I32
        } else {
            Elem::Other
        };
        let device = if obj.getattr(intern!(py, "is_cuda"))?.is_truthy()? {
            Device::Cuda(obj.call_method0(intern!(py, "get_device"))?.extract()?)
        } else if obj.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
            Device::Cpu
        } else {
            Device::Other
        };
        let (ndim, shape) = small_tuple(name, "shape", &obj.getattr(intern!(py, "shape"))?)?;
        let (_, strides) = small_tuple(name, "strides", &obj.call_method0(intern!(py, "stride"))?)?;
        let ptr: usize = obj.call_method0(intern!(py, "data_ptr"))?.extract()?;
        Ok(View {
            name,
            obj: obj.clone(),
            ptr,
            ndim,
            shape: shape.map(|x| x as usize),
            strides,
            elem,
            device,
            readonly: false,
        })
    }

    fn of_numpy(name: &'static str, obj: &Bound<'py, PyAny>) -> PyResult<View<'py>> {
        let py = obj.py();
        let ai = obj.getattr(intern!(py, "__array_interface__"))?;
        let ai = ai.cast::<PyDict>()?;
        let get = |k: &Bound<'py, pyo3::types::PyString>| -> PyResult<Bound<'py, PyAny>> {
            ai.get_item(k)?.ok_or_else(|| {
                PyValueError::new_err(format!("{name}: no {k} in __array_interface__"))
            })
        };
        let typestr: String = get(intern!(py, "typestr"))?.extract()?;
        let elem = match typestr.as_str() {
            "<f4" => Elem::F32,
            "<f2" => Elem::F16,
            "<i4" => Elem::I32,
            // ml_dtypes' bfloat16 shows as two opaque bytes
            "<V2" | "|V2"
                if obj
                    .getattr(intern!(py, "dtype"))?
                    .getattr(intern!(py, "name"))?
                    .extract::<String>()?
                    == "bfloat16" =>
            {
                Elem::Bf16
            }
            _ => Elem::Other,
        };
        let data = get(intern!(py, "data"))?;
        let (ptr, readonly): (usize, bool) = data.extract()?;
        let (ndim, shape) = small_tuple(name, "shape", &get(intern!(py, "shape"))?)?;
        let shape = shape.map(|x| x as usize);
        let strides_obj = get(intern!(py, "strides"))?;
        let size = elem.size() as isize;
        let strides = if strides_obj.is_none() {
            contiguous_strides(&shape[..ndim])
        } else {
            let (_, bytes) = small_tuple(name, "strides", &strides_obj)?;
            let mut s = [0isize; MAX_DIM];
            for i in 0..ndim {
                if bytes[i] % size != 0 {
                    return Err(PyValueError::new_err(format!(
                        "{name}: a stride of {} bytes is not a whole number of elements",
                        bytes[i]
                    )));
                }
                s[i] = bytes[i] / size;
            }
            s
        };
        Ok(View {
            name,
            obj: obj.clone(),
            ptr,
            ndim,
            shape,
            strides,
            elem,
            device: Device::Cpu,
            readonly,
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape[..self.ndim]
    }
    pub fn strides(&self) -> &[isize] {
        &self.strides[..self.ndim]
    }

    /// The dtype's name as the tensor's library gives it, for an error.
    pub fn dtype_name(&self) -> String {
        self.obj
            .getattr("dtype")
            .and_then(|d| d.str())
            .map(|s| s.to_string())
            .unwrap_or_else(|_| "?".into())
    }

    /// A TypeError unless the element type is one of `allowed`.
    pub fn expect_elem(&self, allowed: &[Elem], what: &str) -> PyResult<()> {
        if allowed.contains(&self.elem) {
            return Ok(());
        }
        Err(PyTypeError::new_err(format!(
            "{} must be {what}, got {}",
            self.name,
            self.dtype_name()
        )))
    }

    /// A ValueError unless the shape is `expected` (None: any size there).
    pub fn expect_shape(&self, expected: &[Option<usize>], doc: &str) -> PyResult<()> {
        let ok = self.ndim == expected.len()
            && self
                .shape()
                .iter()
                .zip(expected)
                .all(|(&s, e)| e.is_none_or(|e| e == s));
        if ok {
            return Ok(());
        }
        Err(PyValueError::new_err(format!(
            "{} must have shape {doc}, got {:?}",
            self.name,
            self.shape()
        )))
    }

    /// No negative strides (numpy allows them; the step reads forward).
    pub fn expect_forward(&self) -> PyResult<()> {
        if let Some(i) = self.strides().iter().position(|&s| s < 0) {
            return Err(PyValueError::new_err(format!(
                "{} has a negative stride ({}) in dimension {i}",
                self.name, self.strides[i]
            )));
        }
        Ok(())
    }

    /// Whether dimensions `from..` are contiguous (row-major); a dimension of size 1 may have any stride.
    pub fn contiguous_from(&self, from: usize) -> bool {
        let mut want = 1isize;
        for i in (from..self.ndim).rev() {
            if self.shape[i] != 1 && self.strides[i] != want {
                return false;
            }
            want *= self.shape[i] as isize;
        }
        true
    }

    /// A ValueError unless dimensions `from..` are contiguous.
    pub fn expect_contiguous_from(&self, from: usize, what: &str) -> PyResult<()> {
        if self.contiguous_from(from) {
            return Ok(());
        }
        Err(PyValueError::new_err(format!(
            "{} must be contiguous{}{what} (strides {:?} for shape {:?}); gdn never copies a tensor",
            self.name,
            if what.is_empty() { "" } else { " " },
            self.strides(),
            self.shape()
        )))
    }

    /// Elements from the first one to one past the last one addressed; 0 for an empty tensor.
    pub fn span(&self) -> usize {
        if self.shape().contains(&0) {
            return 0;
        }
        1 + self
            .shape()
            .iter()
            .zip(self.strides())
            .map(|(&n, &s)| (n - 1) * s.unsigned_abs())
            .sum::<usize>()
    }

    /// Bytes `[start, end)` the tensor addresses.
    pub fn byte_range(&self) -> (usize, usize) {
        let span = self.span();
        if span == 0 {
            return (self.ptr, self.ptr);
        }
        (self.ptr, self.ptr + span * self.elem.size())
    }

    /// For a tensor the step writes: writable, and no two of its elements at one address (a stride-0 or an
    /// overlapping view would have the step's writes race or clobber one another).
    pub fn expect_writable(&self) -> PyResult<()> {
        if self.readonly {
            return Err(PyValueError::new_err(format!(
                "{} is read-only; the step writes it in place",
                self.name
            )));
        }
        let mut dims: Vec<(usize, usize)> = self
            .shape()
            .iter()
            .zip(self.strides())
            .filter(|(&n, _)| n > 1)
            .map(|(&n, &s)| (s.unsigned_abs(), n))
            .collect();
        dims.sort();
        let mut extent = 1usize;
        for (s, n) in dims {
            if s < extent {
                return Err(PyValueError::new_err(format!(
                    "{} has elements that share memory (strides {:?} for shape {:?}); the step writes it in place",
                    self.name,
                    self.strides(),
                    self.shape()
                )));
            }
            extent = s * n;
        }
        Ok(())
    }

    /// A ValueError unless the data pointer is aligned to the element (a view of a byte buffer may not be).
    pub fn expect_aligned(&self) -> PyResult<()> {
        if !self.ptr.is_multiple_of(self.elem.size()) {
            return Err(PyValueError::new_err(format!(
                "{}'s data at {:#x} is not aligned to its {}-byte elements",
                self.name,
                self.ptr,
                self.elem.size()
            )));
        }
        Ok(())
    }
}

fn contiguous_strides(shape: &[usize]) -> [isize; MAX_DIM] {
    let mut s = [0isize; MAX_DIM];
    let mut want = 1isize;
    for i in (0..shape.len()).rev() {
        s[i] = want;
        want *= shape[i] as isize;
    }
    s
}

/// A ValueError if the memory of `w` (a tensor the step writes) overlaps `other`'s.
pub fn expect_disjoint(w: &View<'_>, other: &View<'_>) -> PyResult<()> {
    let (a0, a1) = w.byte_range();
    let (b0, b1) = other.byte_range();
    if a0 < b1 && b0 < a1 && w.device == other.device {
        return Err(PyValueError::new_err(format!(
            "{} overlaps {} in memory; the step writes {} in place",
            w.name, other.name, w.name
        )));
    }
    Ok(())
}

/// A view's numbers alone (no Python object), to carry into code that runs without the GIL.
#[derive(Clone, Copy, Debug)]
pub struct Raw {
    pub ptr: usize,
    pub shape: [usize; MAX_DIM],
    pub strides: [isize; MAX_DIM],
    pub elem: Elem,
}

impl View<'_> {
    pub fn raw(&self) -> Raw {
        Raw {
            ptr: self.ptr,
            shape: self.shape,
            strides: self.strides,
            elem: self.elem,
        }
    }
}
